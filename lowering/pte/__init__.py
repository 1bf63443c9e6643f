"""The ExecuTorch program format (``.pte``), written and read without executorch.

- ``program.fbs`` / ``scalar_type.fbs``: lowerflow's schema, field-for-field
  compatible with ExecuTorch's (file identifier ``ET12``);
  ``generated/`` holds the flatc object-API code for it.
- :mod:`.format`: the container (extended header, segments) --
  :func:`serialize` and :func:`deserialize` of :class:`PteData`.
"""

from .format import PteData, PteFormatError, deserialize, read_extended_header, serialize
from .generated import program_generated as schema
from .generated.scalar_type_generated import ScalarType

__all__ = [
    "PteData",
    "PteFormatError",
    "ScalarType",
    "deserialize",
    "read_extended_header",
    "schema",
    "serialize",
]
