"""The ``torch.ops.kdn`` op layer. Importing this package registers every op."""

import torch.distributed

from kdn_compile.ops import (  # noqa: F401
    checkpoints, decode, fp8, gdn, gdn_wy, kda, kdn, recurrent, slots,
)
from kdn_compile.ops._autocast import outside_autocast

if torch.distributed.is_available():  # context parallelism's collectives, DTensor rules
    from kdn_compile.ops import exchange, sharding  # noqa: F401

outside_autocast()  # after every op above is registered
