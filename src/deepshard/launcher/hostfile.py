"""Hostfiles, node specs (``--include`` / ``--exclude``) and the selection they make: pure functions, no processes."""
from __future__ import annotations

import base64
import binascii
import json
import os
import re

HOSTFILE_FORM = "'<hostname> slots=<count>', e.g. 'worker-1 slots=4'"
NODE_SPEC_FORM = "'HOST[:SLOT[,SLOT...]][@HOST[:SLOT...]...]', e.g. 'worker-0@worker-1:0,2'"

_HOST_LINE = re.compile(r"^(\S+)\s+slots\s*=\s*(\d+)$")


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Hostfile ``text`` as ``{host: slots}`` in file order (``#`` comments); a malformed or repeated line,
    zero slots or no hosts raises ``ValueError`` naming ``source``, the line number and the line."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if match is None:
            raise ValueError(
                f"{source}:{lineno}: cannot parse {raw.strip()!r}; each line must read {HOSTFILE_FORM}")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise ValueError(
                f"{source}:{lineno}: host {host!r} is listed again ({raw.strip()!r}); it was first "
                f"listed on line {first_line[host]}; list each host once with its total slots")
        if slots < 1:
            raise ValueError(
                f"{source}:{lineno}: host {host!r} has slots={slots}; a host needs at least 1 slot "
                "(remove the line to leave the host out)")
        hosts[host] = slots
        first_line[host] = lineno
    if not hosts:
        raise ValueError(f"{source} lists no hosts; add lines of the form {HOSTFILE_FORM}")
    return hosts


def read_hostfile(path: str) -> dict[str, int] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"hostfile {path} is not text (byte {err.start} is not UTF-8): it should hold lines "
                         "like 'worker-0 slots=8'; pass the right file with -H/--hostfile") from err
    except OSError as err:
        raise ValueError(f"cannot read hostfile {path}: {err.strerror or err}; fix its permissions or pass "
                         "another file with -H/--hostfile") from err
    if "\x00" in text:
        raise ValueError(f"hostfile {path} is not text (it contains NUL bytes): it should hold lines like "
                         "'worker-0 slots=8'; pass the right file with -H/--hostfile")
    return parse_hostfile(text, source=path)


def parse_node_spec(spec: str) -> dict[str, list[int] | None]:
    """``worker-0@worker-1:0,2`` as ``{"worker-0": None, "worker-1": [0, 2]}`` (None: every slot; repeats merge)."""
    result: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, sep, slot_text = (word.strip() for word in part.partition(":"))
        if not part.strip():
            raise ValueError(f"node spec {spec!r} has an empty entry between '@'s; expected {NODE_SPEC_FORM}")
        if not host:
            raise ValueError(f"node spec {spec!r}: entry {part.strip()!r} has no host name; expected {NODE_SPEC_FORM}")
        bad = [item.strip() for item in slot_text.split(",") if not item.strip().isdigit()] if sep else []
        if bad:
            raise ValueError(f"node spec {spec!r}: slot {bad[0]!r} of host {host!r} is not a non-negative integer; "
                             f"expected {NODE_SPEC_FORM}")
        slots = {int(item) for item in slot_text.split(",")} if sep else None
        earlier = result.get(host, [])
        result[host] = None if slots is None or earlier is None else sorted(slots.union(earlier))
    return result


def _apply_spec(resources: dict[str, int], text: str, flag: str) -> dict[str, list[int]]:
    """``--include`` (``flag``) keeps the hosts and slots ``text`` names, ``--exclude`` drops them."""
    spec = parse_node_spec(text)
    for host, slots in spec.items():
        if host not in resources:
            raise ValueError(f"{flag} {text!r} names host {host!r}, which is not in the hostfile (hosts: "
                             f"{', '.join(resources) or 'none'}); fix the name or add '{host} slots=N' to the hostfile")
        for slot in slots or []:
            if slot >= resources[host]:
                raise ValueError(f"{flag} {text!r} names slot {slot} of host {host!r}, which has {resources[host]} "
                                 f"slots (0..{resources[host] - 1}); pick slots in that range")
    active: dict[str, list[int]] = {}
    for host, count in resources.items():
        named = spec.get(host, [])
        if flag == "--include":
            kept = list(range(count)) if named is None else named
        else:
            kept = [] if named is None else [slot for slot in range(count) if slot not in named]
        if kept:
            active[host] = kept
    return active


def _apply_counts(resources: dict[str, int], num_nodes: int, num_gpus: int) -> dict[str, list[int]]:
    hosts = list(resources)
    if num_nodes != -1:
        if num_nodes < 1:
            raise ValueError(f"--num_nodes {num_nodes} must be >= 1 (or -1 for every host)")
        if num_nodes > len(hosts):
            raise ValueError(
                f"--num_nodes {num_nodes} asks for more hosts than the {len(hosts)} available "
                f"({', '.join(hosts)}); lower --num_nodes or add hosts to the hostfile")
        hosts = hosts[:num_nodes]
    if num_gpus != -1 and num_gpus < 1:
        raise ValueError(f"--num_gpus {num_gpus} must be >= 1 (or -1 for every slot)")
    active: dict[str, list[int]] = {}
    for host in hosts:
        count = resources[host]
        if num_gpus != -1 and num_gpus > count:
            raise ValueError(
                f"--num_gpus {num_gpus} asks for more slots than host {host!r} has ({count}); "
                f"lower --num_gpus to at most {count} or raise that host's slots")
        active[host] = list(range(count if num_gpus == -1 else num_gpus))
    return active


def resolve_resources(resources: dict[str, int], include: str = "", exclude: str = "",
                      num_nodes: int = -1, num_gpus: int = -1) -> dict[str, list[int]]:
    """The slots to launch on, ``{host: [slot, ...]}`` in hostfile order, after ``include`` / ``exclude`` or
    ``num_nodes`` / ``num_gpus`` (the specs and the counts exclude each other)."""
    if include and exclude:
        raise ValueError(f"--include {include!r} and --exclude {exclude!r} are mutually exclusive; "
                         "give only one of them")
    if (include or exclude) and (num_nodes != -1 or num_gpus != -1):
        raise ValueError(
            "Cannot specify num_nodes/gpus with include/exclude: got "
            f"--num_nodes {num_nodes} --num_gpus {num_gpus} with "
            f"{'--include ' + repr(include) if include else '--exclude ' + repr(exclude)}; "
            "either drop --num_nodes/--num_gpus or list the slots in the node spec, "
            "e.g. --include 'worker-0:0,1@worker-1:0,1'")
    if include or exclude:
        active = _apply_spec(resources, include or exclude, "--include" if include else "--exclude")
    else:
        active = _apply_counts(resources, num_nodes, num_gpus)
    if not active:
        raise ValueError(f"no slots left to launch on (hosts {dict(resources)}, include {include!r}, "
                         f"exclude {exclude!r}); keep at least one slot")
    return active


def encode_world_info(active: dict[str, list[int]]) -> str:
    """The selection as one shell-safe token (base64 of JSON), passed to every node's agent."""
    payload = json.dumps([[host, list(slots)] for host, slots in active.items()], separators=(",", ":"))
    return base64.urlsafe_b64encode(payload.encode("utf-8")).decode("ascii")


def decode_world_info(token: str) -> dict[str, list[int]]:
    try:
        items = json.loads(base64.urlsafe_b64decode(token.encode("ascii")).decode("utf-8"))
        world = {str(host): [int(slot) for slot in slots] for host, slots in items}
    except (binascii.Error, UnicodeError, ValueError, TypeError) as exc:
        raise ValueError(f"--world_info {token[:40]!r}... is not a world description written by the "
                         f"deepshard launcher ({exc}); start node agents through deepshard") from None
    if not world or any(not slots for slots in world.values()):
        raise ValueError(f"--world_info describes no ranks ({world}); start node agents through deepshard")
    return world
