"""Integrations with other libraries' models. Each submodule imports its library
only when called, so ``import kdn_compile`` never imports them."""
