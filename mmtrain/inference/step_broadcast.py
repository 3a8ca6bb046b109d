"""Tensor-parallel serving: the server's rank decides, the other ranks of its TP group repeat its model calls.

Only TP rank 0 runs the HTTP server and the scheduler (``DecodeEngine`` with a ``StepLeader``). Before each of its
model calls it sends the other ranks what that call needs: for a decode step the engine's input buffers (last
token and position of every slot, so joins, finished rows and the sampled tokens are all in them), for a prefill
the joining prompts' tokens, slots and last indices. The other ranks (``follow``) run the same call on their
shard, so the model's own TP collectives meet; they never sample (the tokens they need arrive with the next step).

Two channels, because they want different things:

- control words (what the next call is) over a gloo group of the TP ranks, on the host: the followers learn what
  to launch without waiting for their device, and every wait has a timeout. While idle the leader sends a
  heartbeat every half second, so a follower that hears nothing for ``timeout_s`` knows the leader is gone (and
  the leader, whose sends then fail, knows a follower is gone); neither hangs.
- the call's tensors over the TP group itself (NCCL on GPUs: device to device, no host sync on the leader).

One process (TP 1) has no leader: the engine makes no extra call at all.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from mmtrain.parallel.dims import ParallelMesh

_IDLE, _DECODE, _PREFILL, _STOP = 0, 1, 2, 3


class PeerLostError(RuntimeError):
    """A rank of the TP group stopped answering (it exited or hangs); the message names it and the wait."""


class StepChannel:
    """The TP group's links for serving (``mesh``'s TP group; its first rank leads). ``timeout_s`` bounds every
    wait for a control word. Built by every rank of the world together (it makes a process group)."""

    def __init__(self, mesh: ParallelMesh, timeout_s: float = 60.0) -> None:
        self.ranks = mesh.ranks("tp")
        self.leader_rank = self.ranks[0]
        self.group = mesh.tp_group
        self.timeout_s = timeout_s
        self.control = dist.new_group(self.ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._word = torch.zeros(4, dtype=torch.long)

    def send_control(self, op: int, a: int = 0, b: int = 0) -> None:
        self._word[0], self._word[1], self._word[2] = op, a, b
        try:
            dist.broadcast(self._word, self.leader_rank, group=self.control)
        except RuntimeError as exc:  # gloo: a peer closed its connection, or did not take the word in time
            raise PeerLostError(f"a tensor-parallel rank ({self.ranks[1:]}) stopped answering the server rank "
                                f"{self.leader_rank} (within {self.timeout_s:.0f} s): {_first_line(exc)}") from None

    def receive_control(self) -> tuple[int, int, int]:
        try:
            dist.broadcast(self._word, self.leader_rank, group=self.control)
        except RuntimeError as exc:
            raise PeerLostError(f"the server rank {self.leader_rank} sent nothing for {self.timeout_s:.0f} s or "
                                f"went away: {_first_line(exc)}") from None
        op, a, b = self._word[:3].tolist()
        return op, a, b

    def tensor(self, t: torch.Tensor) -> None:
        """Broadcast ``t`` from the leader over the TP group (in place on the followers)."""
        dist.broadcast(t, self.leader_rank, group=self.group)


class StepLeader:
    """What the server rank's engine calls before each model call (``DecodeEngine(peers=...)``)."""

    def __init__(self, channel: StepChannel) -> None:
        self.channel = channel

    def decode(self, last_N1: torch.Tensor, positions_N1: torch.Tensor) -> None:
        self.channel.send_control(_DECODE)
        self.channel.tensor(last_N1)
        self.channel.tensor(positions_N1)

    def prefill(self, tokens_BS: torch.Tensor, slots_B: torch.Tensor, last_B: torch.Tensor) -> None:
        B, S = tokens_BS.shape
        self.channel.send_control(_PREFILL, B, S)
        self.channel.tensor(torch.cat([tokens_BS.reshape(-1), slots_B, last_B]))

    def heartbeat(self) -> None:
        self.channel.send_control(_IDLE)

    def stop(self) -> None:
        """Tell the followers to return (the server is shutting down)."""
        self.channel.send_control(_STOP)


def follow(engine, channel: StepChannel) -> int:
    """A follower's loop: run the leader's model calls on this rank's shard with ``engine`` (a ``DecodeEngine``
    built like the leader's) until it says stop; returns the number of calls run. Raises ``PeerLostError`` when the
    leader is silent for the channel's timeout or gone."""
    calls = 0
    last, positions = engine.decode_inputs
    with torch.no_grad():
        while True:
            op, a, b = channel.receive_control()
            if op == _STOP:
                return calls
            if op == _DECODE:
                channel.tensor(last)
                channel.tensor(positions)
                engine.decode_forward()
            elif op == _PREFILL:
                B, S = a, b
                packed = torch.empty(B * S + 2 * B, dtype=torch.long, device=engine.device)
                channel.tensor(packed)
                engine.prefill_forward(packed[: B * S].view(B, S), packed[B * S: B * S + B], packed[B * S + B:])
            elif op != _IDLE:
                raise PeerLostError(f"the server rank sent an unknown control word {op}")
            calls += op != _IDLE


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
