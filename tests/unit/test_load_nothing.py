"""``load_checkpoint`` with nothing to load: a mistyped directory is named plainly (absolute path, one warning,
``(None, None)`` as DeepSpeed returns), and ``DEEPSHARD_REQUIRE_CHECKPOINT=1`` turns that into an error."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import deepshard


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_nothing_to_load_is_named_and_can_be_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from deepshard.checkpoint.engine_load import REQUIRE_ENV

    created = not dist.is_initialized()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = deepshard.initialize(model=nn.Linear(3, 1), config=cfg)[0]
    handler = _Lines()
    logging.getLogger("deepshard").addHandler(handler)
    try:
        before = [p.detach().clone() for p in engine.module.parameters()]
        assert engine.load_checkpoint("ckpt_typo") == (None, None)
        typo = tmp_path / "ckpt_typo"
        assert handler.lines == [f"load_checkpoint: the checkpoint directory {typo} does not exist: nothing "
                                 f"loaded, training starts from the model's initial state ({REQUIRE_ENV}=1 makes "
                                 "this an error)"]
        assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))

        engine.save_checkpoint("ckpt", tag="step1", save_latest=False)  # a directory without 'latest'
        handler.lines.clear()
        assert engine.load_checkpoint("ckpt") == (None, None)
        assert len(handler.lines) == 1 and f"{tmp_path / 'ckpt'} has no 'latest' file" in handler.lines[0]
        assert "one of the checkpoints there (step1)" in handler.lines[0], handler.lines

        with pytest.raises(FileNotFoundError, match=f"tag='step1'.*{typo} does not exist"):
            engine.load_checkpoint("ckpt_typo", tag="step1")  # an explicit tag: always an error
        monkeypatch.setenv(REQUIRE_ENV, "1")
        handler.lines.clear()
        with pytest.raises(FileNotFoundError, match=f"the checkpoint directory {typo} does not exist"):
            engine.load_checkpoint("ckpt_typo")
        with pytest.raises(FileNotFoundError, match="has no 'latest' file"):
            engine.load_checkpoint("ckpt")
        assert handler.lines == []
        assert engine.load_checkpoint("ckpt", tag="step1")[0] == str(Path("ckpt") / "step1")  # real loads unchanged
        monkeypatch.setenv(REQUIRE_ENV, "yes")
        with pytest.raises(ValueError, match=f"{REQUIRE_ENV}='yes' is not 0 or 1"):
            engine.load_checkpoint("ckpt_typo")
    finally:
        logging.getLogger("deepshard").removeHandler(handler)
        engine.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()
