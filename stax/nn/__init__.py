"""`stax.nn`: PyTorch-spelled namespaces over the flat package (only `functional` so far).

Layer: the top of the stack, beside `stax/__init__.py`; nothing in `stax/` imports it except the
package's lazy `stax.nn` attribute.
"""
from . import functional  # noqa: F401
