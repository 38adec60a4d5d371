"""`stax.nn.attention`: PyTorch's spelling of the attention API (Listing 9.7's import path) over
stax/attention.py (§9.10): omni_attention, create_block_mask, BlockMask."""
from ..attention import (BlockMask, attention_backward, create_block_mask,  # noqa: F401
                         omni_attention, scaled_dot_product_attention)
