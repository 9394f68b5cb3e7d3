"""Service records: where a named service runs, found without a Ray address.

`tokenmill serve --name N` leaves `$TOKENMILL_CACHE/services/N.json` (its Ray address, pid,
host, API URL). `tokenmill stop/status`, `Feed.connect` and every adapter find a service
through it, as one rule (`client.cluster.client_address`). A record is claimed atomically
(O_EXCL) before its service starts, so two `serve --name N` on one machine cannot both run
and overwrite each other's record; a record whose serve process is gone (SIGKILL) is stale
and is removed by whoever finds it. Stdlib and wire/ only: the trainer side imports it too.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from wire.protocol import SERVICE_NAME_RE, check_service_name


class ServiceExists(RuntimeError):
    """A live service of that name already runs here."""


def records_dir() -> Path:
    root = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    return root / "services"


def service_file(name: str) -> Path:
    """Service `name`'s record; ValueError for a name that is not one (`wire.protocol`'s
    rule), so that nothing is ever read, written or deleted outside the services folder."""
    return records_dir() / f"{check_service_name(name)}.json"


def read_record(name: str) -> dict | None:
    """Service `name`'s record, or None (none, unreadable, or stale: removed)."""
    path = service_file(name)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict):
        return None
    if rec.get("host") == socket.gethostname() and local_pid(rec) is None:
        path.unlink(missing_ok=True)  # its serve process is gone
        return None
    return rec


def live_records() -> dict[str, dict]:
    """Every live service record on this machine, by service name."""
    try:
        names = sorted(p.stem for p in records_dir().glob("*.json")
                       if SERVICE_NAME_RE.fullmatch(p.stem))  # fmt: skip
    except OSError:
        return {}
    found = {name: read_record(name) for name in names}
    return {name: rec for name, rec in found.items() if rec is not None}


def recorded_address(name: str) -> str | None:
    """The Ray address in service `name`'s live record (None: no record, or no address yet)."""
    rec = read_record(name)
    return None if rec is None else rec.get("address")


def local_pid(rec: dict) -> int | None:
    """The pid of a record's serve process if it runs on this machine and is alive: the
    same process, not a later one that reused its pid (its start time, where recorded)."""
    pid = rec.get("pid")
    if rec.get("host") != socket.gethostname() or not isinstance(pid, int) or not alive(pid):
        return None
    started = rec.get("started")
    if started is not None and started != start_time(pid):
        return None
    return pid


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc), or None."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def claim(name: str) -> Path:
    """Claim service `name`'s record for this process, atomically; ServiceExists if a live
    serve process holds it. `publish` then fills in the address."""
    path = service_file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"name": name, "pid": os.getpid(), "host": socket.gethostname(),
            "started": start_time(os.getpid())}  # fmt: skip
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            rec = read_record(name)  # removes a stale one
            if rec is not None:
                raise ServiceExists(
                    f"a tokenmill service named {name!r} is already running (serve pid "
                    f"{rec.get('pid', '?')} on {rec.get('host', '?')}); stop it with "
                    f"`tokenmill stop --name {name}` or choose another --name"
                ) from None
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(mine) + "\n")
        return path
    raise ServiceExists(f"could not claim the record of service {name!r} at {path}")


def publish(path: Path, record: dict) -> None:
    """Replace our claimed record with the full one (atomic: readers never see half)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def release(path: Path) -> None:
    """Remove our record, if it is still ours."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its parent, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
