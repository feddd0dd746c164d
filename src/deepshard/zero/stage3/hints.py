"""Errors in a ZeRO-3 forward that come from reading a parameter outside its module's own call.

Under ZeRO-3 a parameter's ``.data`` is an empty placeholder (shape ``[0]``) except while the module
that owns it runs. A module whose forward reads a child's weights without calling the child
(``x @ self.proj.weight.t()``) therefore hands a ``[0]`` tensor to an operator, and torch reports
something like "mat2 must be a matrix, got 1-D tensor", which names neither the cause nor the fix.
:func:`explain_sharded_parameter_errors` re-raises such shape errors with both.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from deepshard.comm.watchdog import CollectiveTimeout
from deepshard.precision.inputs import is_dtype_mismatch

SHAPE_WORDS = ("must be a matrix", "1-D", "shape", "size", "dimension", "mat1", "mat2", "elements", "numel")

HINT = ("under ZeRO-3 a parameter outside its own module's call is an empty placeholder (shape [0], the "
        "real shape in param.ds_shape). If a module's forward reads a child's parameters without calling "
        "the child (e.g. x @ self.proj.weight.t()), gather that module as one unit: "
        "deepshard.utils.set_z3_leaf_modules(model, [ThatModuleClass]) before deepshard.initialize; for a "
        "parameter owned by an unrelated module use deepshard.zero.register_external_parameter(module, param)")


@contextlib.contextmanager
def explain_sharded_parameter_errors(partitioned: bool) -> Iterator[None]:
    """When parameters are partitioned (ZeRO stage 3: the strategy's ``capabilities``), re-raise a shape
    error of the forward as a RuntimeError that adds :data:`HINT` (the original error is chained); anything
    else passes through unchanged, a collective's failure (:class:`CollectiveTimeout`, which names sizes
    too) and a dtype mismatch (``precision/inputs.py`` explains those) included."""
    try:
        yield
    except RuntimeError as exc:
        if not partitioned or isinstance(exc, CollectiveTimeout) or not any(word in str(exc) for word in SHAPE_WORDS):
            raise
        if is_dtype_mismatch(exc):  # "mat1 and mat2 must have the same dtype": the inputs' dtype, not a placeholder
            raise
        raise RuntimeError(f"{exc}\n(deepshard) {HINT}") from exc
