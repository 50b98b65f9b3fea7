"""The base of the record classes: immutable, a pytree node and picklable, from its field names.

A record class (:class:`~lowbit_tree.QTensor`, :class:`~lowbit_tree.rank1.Rank1QTensor`,
:class:`~lowbit_tree.lowrank.LowRankQTensor`) names its fields once, in its constructor's
order: ``CHILDREN``, its tensors (the pytree children; :mod:`lowbit_tree.records` calls them
its parts), then ``STATIC``, its static metadata (part of the tree structure, never leaves).
``WIRING``, the last of ``STATIC``, are set by whoever shards the record (a rank-1 record's
``reduce``): they are not pickled, since they are wiring, not data.

``KERNEL`` says how the step kernels (:mod:`lowbit_tree.kernels`) take a record of the class:
:data:`KERNEL_BLOCKS`, :data:`KERNEL_VALUES`, or ``None`` (no kernel steps it). The kernels read
it, and clone, copy and rebuild records, through this base (:func:`kernel_of`,
:meth:`Record.clone`, :meth:`Record.copy_`, :meth:`Record.with_parts`); everything else reads a
kind's declaration in :mod:`lowbit_tree.records`, which reads these names too. (The kernels
cannot import ``records``: it imports ``lowrank``, whose fast paths import the kernels.)

Defining a subclass registers it with optree (in the global namespace, so that a plain
``optree.tree_map`` reaches its tensors as it does a tuple's), with torch's pytree (as
``lowbit_tree.<class name>``) and as a safe global of ``torch.load(weights_only=True)``.
Unflattening takes the children as they come (:meth:`Record.unchecked`: the static fields in the
tree structure came from a record, so they are normalized already; a ``tree_map`` may put
anything in the children, e.g. shapes, as it may in a tuple).
"""
from __future__ import annotations

import operator

import optree
import optree.registry
import torch
import torch.utils._pytree as torch_pytree

__all__ = ["Record", "KERNEL_BLOCKS", "KERNEL_VALUES", "kernel_of"]

KERNEL_BLOCKS = "blocks"
"""``Record.KERNEL``: the step kernels (C and torch) read its ``codes`` and block ``scale``
(``format``, ``block_size``: a :class:`~lowbit_tree.QTensor`'s fields) and write new ones in the
same pass (in place, or into new tensors)."""

KERNEL_VALUES = "values"
"""``Record.KERNEL``: the kernels step its float32 values, then encode the new values with their
maxima (its parts ``codes``, ``row_max``, ``col_max``: a rank-1 record's), completed across shards
by the record's ``reduce`` in between: a step in two passes, which a
:class:`~lowbit_tree.kernels.plan.KernelPlan` does not hold fixed and the compiled backend runs
eagerly."""


def _getter(names: tuple):
    """``r -> tuple(getattr(r, k) for k in names)``, at attrgetter's speed."""
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else (lambda r: (get(r),))


# optree exposes no public name for its global namespace (where tuples' handlers live)
_GLOBAL_NAMESPACE = getattr(optree.registry, "__GLOBAL_NAMESPACE")


class Record:
    """An immutable record of tensors ``CHILDREN`` and static metadata ``STATIC`` (module docstring)."""

    __slots__ = ()
    CHILDREN: tuple = ()
    STATIC: tuple = ()
    WIRING: tuple = ()
    KERNEL = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        fields = cls.CHILDREN + cls.STATIC
        if (not cls.CHILDREN or "shape" not in cls.STATIC or tuple(cls.__slots__) != fields
                or cls.STATIC[len(cls.STATIC) - len(cls.WIRING):] != cls.WIRING):
            raise TypeError(f"{cls.__name__}: a record class declares CHILDREN (its tensors), then STATIC (with "
                            f"'shape') ending with WIRING, and __slots__ = CHILDREN + STATIC")
        children, static = _getter(cls.CHILDREN), _getter(cls.STATIC)  # (attrgetter: flattening is per step)
        names = cls.CHILDREN
        optree.register_pytree_node(
            cls,
            lambda r: (children(r), static(r), names),
            lambda meta, kids: cls.unchecked(*kids, *meta),
            path_entry_type=optree.GetAttrEntry,
            namespace=_GLOBAL_NAMESPACE,
        )
        torch_pytree.register_pytree_node(
            cls,
            lambda r: (list(children(r)), static(r)),
            lambda kids, meta: cls.unchecked(*kids, *meta),
            serialized_type_name=f"lowbit_tree.{cls.__name__}",
        )
        torch.serialization.add_safe_globals([cls])
        cls._fields = fields
        cls._pickled = fields[: len(fields) - len(cls.WIRING)]
        cls._ready = tuple((k, k != "codes") for k in cls.CHILDREN)  # (part, must be float32) for kernel_ready

    def __init__(self, *values):
        """Sets the fields to ``values`` as given, in ``CHILDREN + STATIC`` order (``WIRING`` left
        out: ``None``). Subclasses normalize their arguments and call this."""
        fields = self._fields
        if len(values) != len(fields):
            if not len(fields) - len(self.WIRING) <= len(values) < len(fields):
                raise TypeError(f"{type(self).__name__} takes {fields}, got {len(values)} values")
            values = values + (None,) * (len(fields) - len(values))
        for name, value in zip(fields, values):  # (object.__setattr__: torch.compile traces it)
            object.__setattr__(self, name, value)

    @classmethod
    def unchecked(cls, *values):
        """A record of ``values`` (``CHILDREN + STATIC`` order) taken as they are: fields already
        normalized (``shape`` a tuple of ints, ...: another record's). The per-step paths build one
        per state and param, where the conversions and checks of the constructor cost a few
        microseconds each."""
        r = object.__new__(cls)
        Record.__init__(r, *values)
        return r

    def with_parts(self, parts: dict):
        """A record of this class with this one's metadata and wiring and the tensors ``parts``
        (``{child name: tensor}``, each of the shape and dtype of this one's: not checked)."""
        r = object.__new__(type(self))
        for k in self.CHILDREN:
            object.__setattr__(r, k, parts[k])
        for k in self.STATIC:
            object.__setattr__(r, k, getattr(self, k))
        return r

    def clone(self):
        """A record of new tensors holding this one's values."""
        return self.with_parts({k: getattr(self, k).clone() for k in self.CHILDREN})

    def copy_(self, src) -> None:
        """Overwrite this record's tensors with ``src``'s (a record of this class and layout), bit
        for bit (fp8 codes are copied as bytes). The record stays the same object."""
        for k in self.CHILDREN:
            d, s = getattr(self, k), getattr(src, k)
            if d.dtype == torch.float8_e4m3fn:
                d, s = d.view(torch.uint8), s.view(torch.uint8)
            d.copy_(s)

    def kernel_ready(self) -> bool:
        """Whether the C kernel can read and write this record's tensors where they are: a class
        it takes (``KERNEL``), every tensor contiguous, every tensor but the codes float32."""
        if self.KERNEL is None:
            return False
        for k, f32 in self._ready:
            t = getattr(self, k)
            if not t.is_contiguous() or (f32 and t.dtype is not torch.float32):
                return False
        return True

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; make a new one (with_parts)")

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self):  # pickling (torch.save / weights_only torch.load): the data, not the wiring
        return (type(self), tuple(getattr(self, k) for k in self._pickled))

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(t.numel() * t.element_size() for t in (getattr(self, k) for k in self.CHILDREN))

    @property
    def device(self) -> torch.device:
        return getattr(self, self.CHILDREN[0]).device


def kernel_of(x) -> str | None:
    """How the step kernels take ``x``: its class's ``KERNEL``, or ``None`` (a plain tensor, or a
    record no kernel steps)."""
    return x.KERNEL if isinstance(x, Record) else None
