"""Command-line side of the config: ``add_config_arguments`` and picking the config source."""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Union

from deepshard.config.base import ConfigError
from deepshard.utils.logging import logger


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags to ``parser`` in a group named "DeepSpeed" and return the parser.

    ``--deepspeed`` (enable, a flag), ``--deepspeed_config PATH``, and the deprecated
    ``--deepscale`` / ``--deepscale_config`` spellings.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the library)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated; use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated; use --deepspeed_config")
    return parser


def _config_from_args(args: Any) -> Optional[Union[str, dict]]:
    ds_config = getattr(args, "deepspeed_config", None)
    scale_config = getattr(args, "deepscale_config", None)
    if scale_config is not None:
        if ds_config is not None:
            raise ConfigError("args.deepspeed_config and the deprecated args.deepscale_config are both set; "
                              "pass only --deepspeed_config")
        logger.warning("--deepscale_config is deprecated; use --deepspeed_config")
        return scale_config
    return ds_config


def _normalise(source: Any) -> Optional[Union[str, dict]]:
    if isinstance(source, os.PathLike):
        return os.fspath(source)
    return source


def resolve_config_source(
        args: Optional[object],
        config: Optional[Union[str, "os.PathLike[str]", dict]]) -> Optional[Union[str, dict]]:
    """Pick the config: ``args.deepspeed_config`` (or the deprecated ``args.deepscale_config``) or
    ``config``. Both given raises :class:`ConfigError`; neither returns None."""
    from_args = _normalise(_config_from_args(args)) if args is not None else None
    config = _normalise(config)
    if from_args is not None and config is not None:
        raise ConfigError(
            f"a config was given twice: args.deepspeed_config={from_args!r} and the config argument; "
            "pass only one (drop --deepspeed_config, or call initialize without config=)")
    return from_args if from_args is not None else config
