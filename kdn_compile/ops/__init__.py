"""The ``torch.ops.kdn`` op layer. Importing this package registers every op."""

from kdn_compile.ops import decode, fp8, gdn, gdn_wy, kda, kdn, recurrent, slots  # noqa: F401
