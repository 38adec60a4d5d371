"""`stax.nn`: PyTorch-spelled namespaces over the flat package (`functional`, `attention`).

Layer: the top of the stack, beside `stax/__init__.py`; nothing in `stax/` imports it except the
package's lazy `stax.nn` attribute.
"""
from . import attention, functional  # noqa: F401
