"""The flatbuffers ``Builder`` of lowerflow's writers (the .pte program, the .ptd
flat tensor file, the XNNPACK payload): the same bytes with every flatbuffers release
the project admits, so a .pte's bytes, and the cache keys of what is computed from them,
do not depend on which one an environment happens to have.

What changed between releases: a builder shares one vtable between objects whose
vtables are equal.  Up to 25.2.10 (which tosa-tools, the Ethos-U extra's dependency,
pins) it compared the field offsets only, so an object could point at the vtable of an
object of another size (the vtable's object-size field then wrong for it); 25.12.19
compares the object size too, and writes a vtable of its own for such an object.  Every
golden program of ``tests/test_pte_golden.py`` has such a pair, so its bytes differed.
:class:`Builder` shares vtables as 25.12.19 does, whatever the installed release; every
other step of the builder writes the same bytes in both (their code was compared).

Before (flatbuffers 25.2.10, two tables with the same field layout, sizes 12 and 16)::

    table A -> vtable V (object size 12)
    table B -> vtable V (object size 12)      # B is 16 bytes

After (this builder, and flatbuffers 25.12.19)::

    table A -> vtable V  (object size 12)
    table B -> vtable V' (object size 16)
"""

from __future__ import annotations

import flatbuffers
from flatbuffers import encode, packer
from flatbuffers import number_types as N
from flatbuffers.builder import VtableMetadataFields


class Builder(flatbuffers.Builder):
    """``flatbuffers.Builder`` whose vtables are shared only between objects of equal
    field offsets and equal size (flatbuffers 25.12.19's rule)."""

    __slots__ = ()

    def WriteVtable(self) -> int:
        """Write the current object's vtable, or point the object at an equal one
        already written (equal field offsets and object size); its offset."""
        # The object's first field: the offset to its vtable, filled in below.
        self.PrependSOffsetTRelative(0)
        object_offset = self.Offset()
        fields = list(self.current_vtable)
        while fields and fields[-1] == 0:  # trailing absent fields take no vtable slot
            fields.pop()
        offsets = [object_offset - field if field else 0 for field in fields]
        object_size = object_offset - self.objectEnd
        key = (*reversed(offsets), object_size)
        shared = self.vtables.get(key)
        if shared is None:
            for offset in reversed(offsets):
                self.PrependVOffsetT(offset)
            self.PrependVOffsetT(object_size)
            self.PrependVOffsetT((len(offsets) + VtableMetadataFields) * N.VOffsetTFlags.bytewidth)
            shared = self.vtables[key] = self.Offset()
        # (the buffer may have grown: the object's position from its start is found again)
        encode.Write(packer.soffset, self.Bytes, len(self.Bytes) - object_offset, shared - object_offset)
        self.current_vtable = None
        return object_offset
