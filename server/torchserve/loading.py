"""Triton's side of serving a registration, the registry's and the explainers' alike: a built config written as
served here, models waited for until Triton has unloaded them, their folders removed."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from common.modelconfig import read_config, served, to_text
from server.errors import ServerError


def write_config(source: Path, target: Path, instances: int | None, wait: bool = True,
                 at_most: int | None = None, max_pixels: int | None = None) -> None:
    """`source` as served here: config.properties' `max_pixels` where given, `instances` (else as built, up to
    `at_most`) of the first group's kind as that many groups of one, and no batch delay where not `wait`: a request
    waits max_batch_delay once, as under TorchServe, in the classifier's batcher (in both, c=1 waited it twice)."""
    # N groups of one, as build-repo writes them: a dead stub is replaced alone
    target.write_text(to_text(served(read_config(source), instances, at_most, None if wait else 0,
                                     None if max_pixels is None else {"max_pixels": str(max_pixels)})))


def wait_unloaded(server, members: list[str], log, limit: float = 120, stuck: float = 10) -> None:
    """Until Triton has unloaded `members`, at most `limit` s (called once the front's requests to them are
    answered, or past their response_timeout); one still UNLOADING after `stuck` s is not waited for: Triton 2.51
    never ends the unload of a model one of whose stubs died with a batch in flight (server/supervisor.py), even
    after its instances were replaced (a DELETE waited the whole 120 s). A new load of the name is a new copy."""
    deadline = time.monotonic() + limit
    unloading: dict[str, float] = {}
    while members and time.monotonic() < deadline:
        try:
            states = {e.get("name"): e.get("state") for e in server.index()}
        except ServerError:
            return
        members = [m for m in members if states.get(m) in ("READY", "UNLOADING", "LOADING")]
        now = time.monotonic()
        for member in members:
            since = unloading.setdefault(member, now) if states[member] == "UNLOADING" else None
            if since is None:
                unloading.pop(member, None)
            elif now - since >= stuck:
                log(f"unloading {member}: still unloading after {stuck:.0f} s (a stub that "
                    "died with a batch in flight: Triton never ends it): not waited for")
                members = [m for m in members if m != member]
                # its stubs never end either: counted as instances never freed (server/supervisor.py)
                server.abandon(stub.pid for stub in server.stubs() if stub.alive and stub.model == member)
        if members:
            time.sleep(0.2)
    if members:
        log(f"unloading {', '.join(members)}: not unloaded after {limit:.0f} s")


def remove(server, members: list[str]) -> None:
    """The served repository's folders of `members` (unloaded) gone."""
    for member in members:
        shutil.rmtree(server.repository / member, ignore_errors=True)
