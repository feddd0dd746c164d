"""DeepSpeed's private engine methods that code written for it (its own unit tests among it) calls, as thin
aliases of deepshard's public functions (the public homes are named on each)."""
from __future__ import annotations

from typing import Any

import torch

from deepshard.precision.cast import cast_for_training
from deepshard.precision.policy import check_param_dtype, mixed_precision_dtypes


class EngineDeepSpeedNames:
    """Mixed into the engine; reads ``self._config``, ``self.module`` and the precision accessors."""

    _config: Any
    module: torch.nn.Module
    fp16_enabled: Any  # the accessors' methods (deepshard.engine_accessors)
    bfloat16_enabled: Any

    def _mixed_precision_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """:func:`deepshard.precision.policy.mixed_precision_dtypes` of this engine's config."""
        return mixed_precision_dtypes(self._config.buffer_dtype, self.fp16_enabled(), self.bfloat16_enabled())

    def _assert_valid_mixed_precision_config(self) -> None:
        """:func:`deepshard.precision.policy.check_param_dtype` of this engine's config."""
        check_param_dtype(self._config.param_dtype, self.fp16_enabled(), self.bfloat16_enabled())

    def _cast_module_mixed_precision(self, param_dtype: torch.dtype | None, buffer_dtype: torch.dtype | None,
                                     is_zero_init_model: bool, keep_pattern: Any = None) -> None:
        """:func:`deepshard.precision.cast.cast_for_training` of this engine's module."""
        if keep_pattern is not None:
            raise NotImplementedError("keep_pattern (DeepSpeed's data_types.keep_in_fp32_modules) is not "
                                      "provided by deepshard; buffers keep their dtype unless buffer_dtype is set")
        cast_for_training(self.module, param_dtype, buffer_dtype, params_already_placed=is_zero_init_model)
