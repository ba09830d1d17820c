"""The transport interface the per-device runner uses, and its error.

A transport moves one message — the tensors of the buffers of its transfers —
between two devices; the runner calls, for each message instruction of
:mod:`attnplan.ir.program` (``tag`` is the message id):

* ``post_send(tag, peer, tensors, flat)``: start sending ``tensors`` as one
  message; they are not modified until ``wait(tag)`` returns; ``flat`` is
  None (the transport packs them with ``runner.pack``) or one uint8 tensor
  already holding them packed;
* ``post_recv(tag, peer, tensors, flat)``: start receiving into ``tensors``
  (allocated from the buffer table as views into the one uint8 tensor
  ``flat``, laid out by ``runner.packed_empty``);
* ``wait(tag)``: block until message ``tag`` completed on this side.

Implementations: the in-memory mailbox of the in-process executor
(:mod:`attnplan.runtime.executor`) and tagged ``isend``/``irecv`` over
torch.distributed (:mod:`attnplan.runtime.dist`). This module imports no torch.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..errors import TransportError  # noqa: F401  (re-exported: the runtime raises it)


class Transport(Protocol):
    def post_send(self, tag: int, peer: int, tensors: Sequence, flat=None) -> None: ...

    def post_recv(self, tag: int, peer: int, tensors: Sequence, flat=None) -> None: ...

    def wait(self, tag: int) -> None: ...
