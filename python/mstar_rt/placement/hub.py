"""The parent's receiving end: one thread that takes every worker's replies and hands each to its
worker's link (placement/link.py).

Local worker processes write their replies into a shared-memory mailbox each and ring the
parent's one bell (placement/mailbox.py); Ray actors, which may be on other machines, push
theirs to a ZeroMQ socket, tensors inside (``inline``). A local worker's ``fatal`` at start,
sent before its mailbox is open, comes over the socket too. The thread sleeps in one ``poll``
over the socket and the bell."""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from typing import TYPE_CHECKING, Mapping, Optional

import zmq

from mstar_rt import _core
from mstar_rt.placement.channel import mark_hub_thread
from mstar_rt.placement.mailbox import Bell
from mstar_rt.placement.protocol import TO_PARENT_HEADER

if TYPE_CHECKING:
    from mstar_rt.placement.link import WorkerLink


class Hub:
    """``endpoint``: where the socket binds (``tcp://host:*`` picks a port: see
    :attr:`endpoint`); ``bell_path``: the FIFO local workers ring (None: Ray actors only)."""

    def __init__(self, zctx: zmq.Context, endpoint: str, inline: bool = False,
                 bell_path: Optional[str] = None, spin_us: float = 0.0) -> None:
        self.inline, self.spin_s = inline, spin_us * 1e-6
        self.sock = zctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.bell = Bell(bell_path, create=True) if bell_path is not None else None
        self.links: dict[int, "WorkerLink"] = {}
        self.bad_frames = 0
        self._stop = False
        self.sleeping = False  # in poll, waiting for a bell (expect() rings it)
        self._thread = threading.Thread(target=self._run, name="mstar-placement-hub", daemon=True)

    def start(self, links: Mapping[int, "WorkerLink"]) -> None:
        self.links = dict(links)
        self._thread.start()

    def _run(self) -> None:
        sock, bell = self.sock, self.bell
        mark_hub_thread()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if bell is not None:
            poller.register(bell.fileno(), zmq.POLLIN)
        while not self._stop:
            mail = self._mail_soon()
            timeout = 0 if mail else 1 if any(link.holds for link in self.links.values()) else 100
            self.sleeping = timeout > 0
            ready = dict(poller.poll(timeout))
            self.sleeping = False
            if mail:
                ready[bell.fileno()] = zmq.POLLIN
            if not ready:
                for link in self.links.values():
                    link.flush_posts(held=True)
                continue
            if bell is not None and bell.fileno() in ready:
                bell.drain()  # before the rings: a reply written after this rings again
                for link in self.links.values():
                    for frames in link.take_mail():
                        self._deliver(frames, link)
            if sock in ready:
                if self.inline:  # tensor frames stay in ZeroMQ's buffers until decoded
                    got = sock.recv_multipart(copy=False)
                    frames = [f.bytes for f in got[:2]] + [f.buffer for f in got[2:]]
                else:
                    frames = sock.recv_multipart()
                self._deliver(frames, None)

    def expect(self) -> None:
        """A batch just left for a worker: wakes this thread if it sleeps, so that it watches
        the mailboxes for the reply (:meth:`_mail_soon`) while the worker runs, instead of
        being woken by the reply's bell (a wake-up costs tens of µs on a VM, and the reply
        then waits for it). A thread that just went to sleep is woken by the reply as before."""
        if self.sleeping and self.spin_s > 0 and self.bell is not None:
            self.bell.ring()

    def _mail_soon(self) -> bool:
        """Whether a reply arrived within the spin budget: the local workers' mailbox heads
        watched without sleeping (placement/mailbox.py), each kept mapped meanwhile."""
        if self.spin_s <= 0 or self.bell is None:
            return False
        with contextlib.ExitStack() as stack:
            watched = [w for link in self.links.values()
                       if (w := stack.enter_context(link.inbox.watched())) is not None]
            return bool(watched) and _core.spin_until_changed(
                [a for a, _ in watched], [v for _, v in watched], self.spin_s) >= 0

    def _deliver(self, frames: list, via: Optional["WorkerLink"]) -> None:
        """One reply to its link; ``via``: the link whose mailbox it came from."""
        header = TO_PARENT_HEADER
        if (len(frames) != 2 and not (self.inline and via is None)) or len(frames) < 2 \
                or len(frames[0]) != header.size:
            self.bad_frames += 1
            return
        rank, gen, span = header.unpack(frames[0])
        link = self.links.get(rank)
        if link is None or (via is not None and link is not via):
            self.bad_frames += 1
            return
        try:
            link.on_message(gen, span, frames[1], frames[2:])
            for each in self.links.values():  # releases it caused, now the caller woke
                each.flush_posts()
        except Exception:  # a bug here must not stop every worker's replies
            traceback.print_exc()

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sock.close(0)
        if self.bell is not None:
            self.bell.close(unlink=True)


def bell_path(workdir: str) -> str:
    return os.path.join(workdir, "parent.bell")


__all__ = ["Hub", "bell_path"]
