"""The checkpoint format shared by every ZeRO stage: parameter *fragments* keyed by name and offset.

Each rank writes ``zero_rank<r>.safetensors`` + ``zero_rank<r>.json`` holding the fp32 values and the
optimizer state of the fragments it owns (stage 0: rank 0 owns every parameter whole; stages 1-2: each
rank its partition). Rank 0 also writes ``module_extra.safetensors``: buffers and frozen parameters.
Loading reassembles full tensors per parameter name from all ranks' files (``read_fragments``), and a
strategy then takes the slices it owns, so a checkpoint written by any stage on any number of processes
loads into any stage on any number of processes directly, with no conversion step.

Tensor keys: ``param/<name>@<start>`` (fp32 values), ``optim/<name>/<key>@<start>`` (an elementwise
state slice), ``optim/<name>/<key>@scalar`` (a 0-d state such as Adam's ``step``) and
``optim/<name>/<key>@whole`` (a non-elementwise state of a parameter owned whole).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint import schema
from deepshard.checkpoint.matching import check_coverage
from deepshard.checkpoint.share import LoadShare, uncovered
from deepshard.shard_state import FragmentRecord, FullState

MODULE_EXTRA = "module_extra.safetensors"
_RANK_JSON = re.compile(r"^zero_rank(\d+)\.json$")
_TENSOR_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")
_EXTRA = re.compile(r"^module_extra(_rank\d+)?\.safetensors$")
FORMAT_VERSION = 2
"""1: fragments of whole tensors. 2: a fragment may be of a tensor-parallel part: the rank file's
``splits`` maps a name to ``[dim, index, parts]`` and ``shapes`` holds the part's shape; ``coord``
records the writer's grid coordinate. Version-1 files have neither and load as before."""


def extra_file(rank: int) -> str:
    """Buffers and frozen weights of one model slice: written by the first data-parallel rank of each
    (pipeline, tensor) slice; global rank 0 keeps the version-1 name."""
    return MODULE_EXTRA if rank == 0 else f"module_extra_rank{rank}.safetensors"


def rank_files(rank: int) -> tuple[str, str]:
    return f"zero_rank{rank}.safetensors", f"zero_rank{rank}.json"


def save_rank_fragments(directory: Path, rank: int, records: list[FragmentRecord],
                        shapes: dict[str, tuple[int, ...]], param_groups: list[dict[str, Any]] | None,
                        aliases: dict[str, str], module_extra: dict[str, torch.Tensor] | None,
                        meta: dict[str, Any], splits: dict[str, list[int]] | None = None,
                        coord: dict[str, int] | None = None, tensor_file: str | None = None) -> list[str]:
    """Write this rank's fragments (``rank``: the global rank, the file name); returns the file names.
    ``splits``: the tensor-parallel parts among them, ``name -> [dim, index, parts]``. ``tensor_file``: the
    name of the tensors file (weights and optimizer state; default ``zero_rank<rank>.safetensors``), recorded
    in the rank's JSON for the reader."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for rec in records:
        tensors[f"param/{rec.name}@{rec.start}"] = rec.value.detach().reshape(-1)
        whole = rec.start == 0 and rec.numel == _numel(shapes[rec.name])
        for key, value in rec.state.items():
            if not torch.is_tensor(value):
                scalars.setdefault(f"{rec.name}@{rec.start}", {})[key] = value
            elif value.dim() == 0:
                tensors[f"optim/{rec.name}/{key}@scalar"] = value.detach()
            elif value.numel() == rec.numel:
                tensors[f"optim/{rec.name}/{key}@{rec.start}"] = value.detach().reshape(-1)
            elif whole:
                tensors[f"optim/{rec.name}/{key}@whole"] = value.detach()
            else:
                raise ValueError(
                    f"optimizer state '{key}' of parameter '{rec.name}' has shape {tuple(value.shape)}, which is "
                    f"not elementwise (the fragment has {rec.numel} elements); optimizers with factored or "
                    "per-layer state cannot be partitioned by ZeRO stages 1-3: use stage 0")
    default_tensors, json_file = rank_files(rank)
    tensor_file = _plain_file_name(tensor_file or default_tensors)
    ckpt_io.save_tensors(directory / tensor_file, tensors)
    info = {"rank": rank, "version": FORMAT_VERSION, "tensors": tensor_file,
            "fragments": [[r.name, r.start, r.numel] for r in records],
            "scalars": scalars, "shapes": {k: list(v) for k, v in shapes.items()},
            "order": list(shapes), "aliases": aliases,
            "meta": meta, "splits": splits or {}, "coord": coord or {}}
    if param_groups is not None:
        info["param_groups"] = param_groups
    if module_extra is not None:  # which file holds this slice's buffers and frozen weights
        info["extra"] = {"file": extra_file(rank)}
    ckpt_io.save_json(directory / json_file, info)
    files = [tensor_file, json_file]
    if module_extra is not None:
        ckpt_io.save_tensors(directory / extra_file(rank), module_extra)
        files.append(extra_file(rank))
    return files


def _plain_file_name(name: str) -> str:
    """``name`` if it is a file name inside the tag directory (no directory part, a ``.safetensors`` file)."""
    if not _TENSOR_FILE.match(name):
        raise ValueError(f"rank tensors file name {name!r} is not a plain '<name>.safetensors' file name inside "
                         "the tag directory; name it with letters, digits, '_', '-' and '.' only")
    return name


def tensor_file_of(info: dict[str, Any], rank: int) -> str:
    """The tensors file a rank's JSON names (files written before it was recorded: the default name)."""
    name = str(info.get("tensors") or rank_files(rank)[0])
    if not _TENSOR_FILE.match(name):
        raise ckpt_io.CheckpointError(f"{rank_files(rank)[1]} names its tensors file {name!r}, which is not a file "
                                      "name inside the tag directory: the checkpoint was edited; load another tag")
    return name


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def read_fragments(directory: Path, with_optimizer: bool = True, module: torch.nn.Module | None = None,
                   share: LoadShare | None = None) -> FullState:
    """Reassemble full fp32 parameters (and optimizer state) from a deepshard tag's rank files (a tag of
    either format: ``checkpoint.reader.load_full_state``).

    Tensor-parallel parts are put back together along their split dimension (global tensors). With
    ``module``, only the files holding tensors that module has are read, and the result is cut back to
    ``module``'s own tensor-parallel parts (``checkpoint/layout.py``), ready for a strategy to take its
    slices. A pipeline stage reads the rank files of its own stage, its own first, and stops once its
    tensors are whole: another stage's files are not opened, not even their JSON.

    With ``share`` (``checkpoint/share.py``), only the tensor files holding fragments that overlap this
    rank's ranges are read, the rank files' JSON in the same order until the ranges are covered; the other
    elements are zeros (the strategy fills them from its peers)."""
    from deepshard.checkpoint.layout import wanted_names

    listing = _listing(directory)
    ranks = sorted(int(m.group(1)) for name in listing if (m := _RANK_JSON.match(name)))
    if not ranks:
        raise ckpt_io.CheckpointError(
            f"{directory} holds no zero_rank*.json files: it is not a deepshard checkpoint tag directory "
            "(pass the directory that contains the tag folders and the 'latest' file, or the tag itself)")
    wanted = wanted_names(module) if module is not None else None
    trainable = set(share.ranges) if share is not None and wanted is None else _trainable_wanted(module, wanted)
    reading = _Reading(directory, with_optimizer, wanted, trainable, share)
    for rank in _reading_order(ranks, module, _first_rank(ranks, share)):
        if reading.done():
            break
        reading.read_json(rank)
    reading.finish_skipped()
    check_coverage(directory, *reading.coverage(), ranks, reading.saved_world or None)
    if share is not None:
        reading.parts.fill_unread(reading.cut_alike)
    params, optim, kinds, shapes = reading.parts.finish()
    module_extra: dict[str, torch.Tensor] = {}
    for extra in reading.extra_files(listing):
        module_extra.update(ckpt_io.load_tensors(directory / extra, names=reading.wanted()))
    full = FullState(params, optim, kinds, reading.groups, module_extra, reading.aliases, shapes, reading.meta)
    return _localized(full, module)


def _localized(full: FullState, module: torch.nn.Module | None) -> FullState:
    from deepshard.checkpoint.layout import localize

    return localize(full, module) if module is not None else full


def _listing(directory: Path) -> list[str]:
    """The tag directory's file names: the manifest's while ``load_checkpoint`` verifies (no directory scan
    of a directory holding every rank's files), else the directory's own."""
    from deepshard.checkpoint.ledger import verifier_for

    verifier = verifier_for(directory / "x")
    if verifier is not None and verifier.directory == directory:
        return list(getattr(verifier, "files", None) or [p.name for p in directory.iterdir()])
    return [p.name for p in directory.iterdir()]


def _trainable_wanted(module: torch.nn.Module | None, wanted: set[str] | None) -> set[str] | None:
    """The trainable parameter names a pipeline stage must find in fragments (None: not a stage)."""
    if module is None or wanted is None:
        return None
    return {n for n, p in module.named_parameters() if p.requires_grad}


def _first_rank(ranks: list[int], share: LoadShare | None) -> int | None:
    """The rank whose file a share reads first: the one named ``share.first_file``, else the loading rank."""
    if share is None:
        return None
    named = [r for r in ranks if rank_files(r)[0] == share.first_file]
    return named[0] if named else share.rank


def _reading_order(ranks: list[int], module: torch.nn.Module | None, first: int | None = None) -> list[int]:
    """Rank files in the order a model slice reads them: the file of its own rank, then those of the ranks
    that hold the same pipeline stage on this grid, then the rest (only read if still needed). A whole
    model loading a share (``first``: its rank) reads its own file first, then the others in order."""
    topology = getattr(module, "grid_topology", None)
    dims, own = getattr(topology, "dims", None), getattr(topology, "rank", None)
    if dims is None or own is None or dims.world_size <= 0:
        return sorted(ranks, key=lambda r: (r != first, r))
    stage = dims.coord(own).pp

    def key(rank: int) -> tuple[int, int]:
        if rank == own:
            return (0, rank)
        same = rank < dims.world_size and dims.coord(rank).pp == stage
        return (1 if same else 2, rank)

    return sorted(ranks, key=key)


class _Reading:
    """The rank files read so far for one model slice, and whether its tensors are whole yet."""

    def __init__(self, directory: Path, with_optimizer: bool, wanted_own: set[str] | None,
                 trainable: set[str] | None, share: LoadShare | None = None) -> None:
        from deepshard.checkpoint.layout import Reassembly

        self.directory, self.wanted_own, self.trainable, self.share = directory, wanted_own, trainable, share
        self.parts = Reassembly(with_optimizer)
        self.with_optimizer = with_optimizer
        self.aliases: dict[str, str] = {}
        self.groups: list[dict[str, Any]] | None = None
        self.meta: dict[str, Any] = {}
        self.saved_world = 0
        self.infos: dict[int, dict[str, Any]] = {}
        self.skipped: list[int] = []

    def wanted(self) -> set[str] | None:
        from deepshard.checkpoint.layout import with_alias_sources

        return with_alias_sources(self.wanted_own, self.aliases)

    def read_json(self, rank: int) -> None:
        path = self.directory / rank_files(rank)[1]
        info = schema.check_rank_info(path, ckpt_io.load_json(path), rank)
        self.infos[rank] = info
        self.aliases.update(info.get("aliases", {}))
        if rank == 0 or not self.meta:
            self.meta = info.get("meta", self.meta)
        self.groups = self.groups if self.groups is not None else info.get("param_groups")
        self.saved_world = max(self.saved_world, int(info.get("meta", {}).get("dp_world_size", 0) or 0))
        self._take(rank, info)

    def _take(self, rank: int, info: dict[str, Any]) -> None:
        wanted = self.wanted()
        self.parts.declare(info, wanted)
        if self._foreign_only(info, wanted):
            self.skipped.append(rank)  # another stage's tensors: its tensor file is not opened
        elif self.parts.needs(info, wanted) and self._in_share(info, wanted):
            self.parts.add(info, ckpt_io.load_tensors(self.directory / tensor_file_of(info, rank)), wanted)

    def _in_share(self, info: dict[str, Any], wanted: set[str] | None) -> bool:
        """Whether the file holds a fragment of this rank's share (always, without a share)."""
        if self.share is None:
            return True
        splits = info.get("splits", {})
        return any(self.share.wants(name, int(start), int(numel), splits.get(name))
                   for name, start, numel in info["fragments"] if wanted is None or name in wanted)

    def cut_alike(self, name: str) -> bool:
        """Whether this rank loads a share of ``name`` that maps onto the saved parts (then the parts and
        ranges outside it need not be read)."""
        return self.share is not None and self.share.needed(name, self.parts.saved_split(name)) is not None

    def coverage(self) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """``(declared shapes, elements found)`` for ``matching.check_coverage``: with a share, a tensor
        counts as found whole once this rank's ranges of it are."""
        declared, covered = self.parts.coverage()
        if self.share is None:
            return declared, covered
        covered = dict(covered)
        for key, (label, shape, split) in self.parts.declared_keys.items():
            needed = self.share.needed(key[0], split)
            if needed is not None and not uncovered(needed, self.parts.spans.get(key, [])):
                covered[label] = _numel(shape)
        return declared, covered

    @staticmethod
    def _foreign_only(info: dict[str, Any], wanted: set[str] | None) -> bool:
        return wanted is not None and _foreign_fragments(info, wanted) == len(info["fragments"])

    def finish_skipped(self) -> None:
        """Files skipped before a tied weight's alias was known: read them if they now hold wanted tensors."""
        for rank in self.skipped:
            info = self.infos[rank]
            wanted = self.wanted()
            self.parts.declare(info, wanted)
            if not self._foreign_only(info, wanted) and self.parts.needs(info, wanted) and self._in_share(info, wanted):
                self.parts.add(info, ckpt_io.load_tensors(self.directory / tensor_file_of(info, rank)), wanted)

    def done(self) -> bool:
        """A pipeline stage's tensors are whole: every trainable parameter declared and covered, every
        tensor-parallel part present, its optimizer hyper-parameters found. With a share, the same for
        a whole model, counting only its own ranges and parts (``cut_alike``); without, never for a whole
        model (it reads every rank file)."""
        if self.trainable is None or not self.infos:
            return False
        if self.with_optimizer and self.groups is None:
            return False
        declared, covered = self.coverage()
        if any(covered.get(label, 0) < _numel(shape) for label, shape in declared.items()):
            return False
        names = {label.split("[tp ", 1)[0] for label in declared}
        if any(self.aliases.get(n, n) not in names and n not in names for n in self.trainable):
            return False
        return all((name, i) in self.parts.values for name, (_, count, _) in self.parts.splits.items()
                   if not self.cut_alike(name)
                   for i in range(count))

    def extra_files(self, listing: list[str]) -> list[str]:
        """The buffer / frozen-weight files to read: those the read rank files name as theirs (a pipeline
        stage's own), else (older checkpoints, or a whole model) every one in the directory."""
        named = sorted({info["extra"]["file"] for info in self.infos.values() if isinstance(info.get("extra"), dict)})
        if self.wanted_own is not None and named:
            return named
        return sorted(name for name in listing if _EXTRA.match(name))


def _foreign_fragments(info: dict[str, Any], wanted: set[str] | None) -> int:
    """How many of a rank file's fragments the loading model slice does not want: files of this slice's
    own tensors are read first, so a copy it shares with another slice (a tied layer) comes from them."""
    return 0 if wanted is None else sum(1 for name, _, _ in info["fragments"] if name not in wanted)
