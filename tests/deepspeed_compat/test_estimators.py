"""DeepSpeed's model-state memory estimators: deepshard prints DeepSpeed 0.19.8's rows and numbers, line for
line, for the same models and setups (real DeepSpeed run as a subprocess)."""
from __future__ import annotations

import contextlib
import io

from tests.deepspeed_compat.estimator_models import SETUPS, print_all
from tests.deepspeed_compat.real import needs_deepspeed, run_deepspeed


@needs_deepspeed
def test_estimator_tables_match_deepspeed() -> None:
    code = ("from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live as s3\n"
            "from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live as s2\n"
            "from tests.deepspeed_compat.estimator_models import print_all\n"
            "print('=====')\nprint_all(s3, s2)\n")
    theirs = run_deepspeed(code).split("=====\n", 1)[1]
    from deepshard.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live as s3
    from deepshard.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live as s2

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_all(s3, s2)
    assert out.getvalue().splitlines() == theirs.splitlines()
    assert sum("zero_init" in line for line in theirs.splitlines()) == 6 * len(SETUPS)
