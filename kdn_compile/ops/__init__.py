"""The ``torch.ops.kdn`` op layer. Importing this package registers every op."""

from kdn_compile.ops import fp8, gdn, kda, kdn, recurrent  # noqa: F401
