"""One engine's part in handing a disaggregated request's KV from its prefill replica to
its decode replica: the ``kv_*`` utility methods of the engine process.

The front end (:mod:`schedkit.cluster.handoff`) drives a hand-off over the connections
it already has to both engines, in this order:

1. decode engine, ``kv_reserve(request id, block hashes, prompt tokens)``: the leading
   blocks it holds already, room held for the rest; or None, no room yet (ask again);
2. prefill engine, ``kv_export(request id, first block)``: the payload of the blocks
   its finished prefill kept, from that block on;
3. decode engine, ``kv_import(request id, first block, payload)``: the KV arrived;
4. prefill engine, ``kv_release(request id)``: it frees the kept blocks;

then the request itself is added to the decode engine, which loads the received blocks
at the step that admits it. ``kv_cancel(request id)`` on the decode engine forgets a
hand-off that will not be completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schedkit.errors import ConfigError, RequestError
from schedkit.kv.connector import KVConnectorRole
from schedkit.kv.connectors.transfer import KVReceipt, TransferConnector

KV_METHODS = ("kv_reserve", "kv_export", "kv_import", "kv_release", "kv_cancel")
"""The utility methods of a hand-off (``migrate_out`` starts one for a running request)."""


class KVHandoffs:
    """The ``kv_*`` utility methods of one engine.

    Args:
        engine: The engine core (its scheduler's connector, its runner's worker side).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        connector = engine.scheduler.connector
        self.connector: TransferConnector | None = connector if isinstance(connector, TransferConnector) else None
        worker = getattr(engine.runner, "kv_connector", None)
        self.worker: Any = (worker if isinstance(worker, TransferConnector)
                            and worker.role is KVConnectorRole.WORKER else None)
        self.num_exported_bytes = 0
        self.num_imported_bytes = 0

    def _connector(self) -> TransferConnector:
        if self.connector is None:
            raise ConfigError(f"this engine runs the KV connector {type(self.engine.scheduler.connector).__name__!r}, "
                              "not kv-transfer: a disaggregated cluster needs kv-transfer on every replica "
                              "(switch the other connector plugin off)")
        return self.connector

    def send_when_finished(self, request_id: str) -> None:
        """Keep the request's prompt blocks when it finishes (a ``kv_send`` request)."""
        self._connector().send_when_finished(request_id)

    def migrate_out(self, args: Sequence[Any]) -> tuple[Any, dict[str, Any]] | None:
        """``migrate_out(request id)``: stop the request here at this step boundary, keep
        the full blocks of its computed tokens, and return it with its state for its new
        engine (``block_ids``, ``block_hashes``, ``output_token_ids``); None while a step
        is in flight (ask again).

        Raises:
            RequestError: No unfinished request of that id runs or waits here.
            ConfigError: This engine does not run the transfer connector.
        """
        conn = self._connector()
        (rid,) = _arity("migrate_out", args, 1)
        engine = self.engine
        req = engine.scheduler.requests.get(rid) if isinstance(rid, str) else None
        if req is None or req.is_finished:
            raise RequestError(f"migrate_out: no unfinished request {rid!r} runs or waits here")
        if engine.num_steps_in_flight:
            return None
        conn.send_when_finished(rid)
        engine.abort_requests(rid)
        blocks = conn.held_blocks(rid) or []
        return req, {"block_ids": list(blocks), "block_hashes": list(req.block_hashes[:len(blocks)]),
                     "output_token_ids": list(req.output_token_ids)}

    def call(self, method: str, args: Sequence[Any]) -> Any:
        """Run ``kv_*`` utility ``method``.

        Raises:
            RequestError: Bad arguments, or nothing is kept for that request.
            ConfigError: This engine does not run the transfer connector.
        """
        conn = self._connector()
        rid = args[0] if args else None
        if not isinstance(rid, str) or not rid:
            raise RequestError(f"{method}: the first argument must be a request id, got {rid!r}")
        if method == "kv_reserve":
            _, hashes, num_tokens = _arity(method, args, 3)
            if not (isinstance(hashes, list) and all(isinstance(h, bytes) for h in hashes)):
                raise RequestError(f"kv_reserve: block hashes must be a list of bytes, got {type(hashes).__name__}",
                                   request_id=rid)
            if type(num_tokens) is not int or num_tokens < 1:
                raise RequestError(f"kv_reserve: prompt tokens must be a positive int, got {num_tokens!r}",
                                   request_id=rid)
            sched = self.engine.scheduler
            return conn.reserve(rid, hashes, num_tokens, busy=sched.has_requests())
        if method == "kv_export":
            _, first = _arity(method, args, 2)
            blocks = conn.held_blocks(rid)
            if blocks is None:
                raise RequestError(f"kv_export: no KV is kept for request {rid!r} (it did not finish a "
                                   "kv_send prefill here, or was released)", request_id=rid)
            if type(first) is not int or not 0 <= first <= len(blocks):
                raise RequestError(f"kv_export: first block must be an int in [0, {len(blocks)}], got {first!r}",
                                   request_id=rid)
            payload: dict[str, Any] = (self.worker.export_blocks(blocks[first:]) if self.worker is not None
                       else {"num_blocks": len(blocks) - first})
            self.num_exported_bytes += len(payload.get("data", b""))
            return payload
        if method == "kv_import":
            _, first, payload = _arity(method, args, 3)
            if type(first) is not int or first < 0:
                raise RequestError(f"kv_import: first block must be a non-negative int, got {first!r}",
                                   request_id=rid)
            num = payload.get("num_blocks") if isinstance(payload, dict) else None
            if type(num) is not int or num < 0:
                raise RequestError(f"kv_import: the payload must be a dict with an int num_blocks, got "
                                   f"{type(payload).__name__}", request_id=rid)
            if self.worker is not None:
                self.worker.stage(rid, payload)
            bs = conn.block_size
            conn.receive(rid, KVReceipt(first * bs, (first + num) * bs))
            self.num_imported_bytes += len(payload.get("data", b""))
            return True
        if method == "kv_release":
            _arity(method, args, 1)
            return conn.sent(rid)
        if method == "kv_cancel":
            _arity(method, args, 1)
            if self.worker is not None:
                self.worker.drop(rid)
            return conn.cancel(rid)
        raise AssertionError(method)

    def stats(self) -> dict[str, Any]:
        conn = self.connector
        if conn is None:
            return {}
        return {"kv_transfer_held_blocks": conn.num_held_blocks, "kv_transfer_reserved_blocks": conn.num_reserved_blocks,
                "kv_transfer_exported_bytes": self.num_exported_bytes,
                "kv_transfer_imported_bytes": self.num_imported_bytes,
                "kv_transfer_received_tokens": conn.num_tokens_received}


def _arity(method: str, args: Sequence[Any], n: int) -> Sequence[Any]:
    if len(args) != n:
        raise RequestError(f"{method} takes {n} arguments, got {len(args)}")
    return args
