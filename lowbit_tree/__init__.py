"""lowbit-tree: block-wise quantized (8-bit, 4-bit, FP8) optimizer states as pytrees."""
from .formats import FORMATS, STATE_FORMATS, Format, get_format
from .qtensor import QTensor, dequantize, has_nonfinite, quantize, row_layout, zeros

__version__ = "0.1.0"
