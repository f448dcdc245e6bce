"""vLLM's KV-cache events (``--kv-events-config``) as block keys in ``wire.prefix.chain``'s space.

vLLM publishes, per engine step, a msgpack ``KVEventBatch`` (``[ts, events, dp_rank]``, array
encoded) of tagged events (a map with ``"type"``): ``BlockStored`` (``block_hashes``,
``parent_block_hash``, the blocks' ``token_ids``, ``block_size``), ``BlockRemoved``
(``block_hashes``) and ``AllBlocksCleared`` (``vllm/distributed/kv_events.py``). Its block
hashes are its own (sha256 of its hash seed, the parent and the tokens); the gateway cannot make
them from a request. So each stored block is re-keyed here as ``chain([its token ids],
parent=our key of its parent block)``: the same key the gateway makes from the request's token
ids (``token_prefix``), and a map engine hash -> our key resolves later parents and removals.

Blocks that cannot be keyed are skipped, never guessed: a parent never seen (events missed, or
published before the subscriber joined), or blocks whose engine hash covers more than the tokens
(a LoRA adapter, a cache salt, multimodal inputs: ``extra_keys``), since a plain prompt with
the same tokens does not hit them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from qosgate.core.prefix import Prefix
from qosgate.wire.prefix import chain, token_blocks

EngineHash = bytes | int


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[EngineHash]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_items = msgspec.msgpack.Decoder(list[msgspec.Raw])
_event = msgspec.msgpack.Decoder(KVEvent)


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one published batch (``[ts, events, dp_rank?]``), in order; an event of a
    kind this module does not know (a later vLLM's) is left out. ``msgspec.DecodeError`` if the
    batch itself is garbled."""
    head = _items.decode(payload)
    if len(head) < 2:
        raise msgspec.DecodeError("a KV event batch has a timestamp and a list of events")
    events: list[KVEvent] = []
    for raw in _items.decode(head[1]):
        try:
            events.append(_event.decode(raw))
        except msgspec.DecodeError:
            continue
    return events


@dataclass
class CacheChange:
    """What one stretch of events did to an engine's cache, in our keys, net of itself (a block
    stored then removed within it is neither). ``cleared``: the engine dropped everything
    *before* ``stored`` (vLLM's prefix-cache reset)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    skipped: int = 0  # blocks that could not be keyed (see the module's docstring)

    @property
    def empty(self) -> bool:
        return not (self.stored or self.removed or self.cleared)


class EngineBlocks:
    """One engine's cached blocks: its hash -> our key, fed its events in the order published.

    ``limit`` bounds the map (the oldest entries go first): a safety net against missed
    removals; an engine's cache holds far fewer blocks."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self.keys: dict[EngineHash, int] = {}
        self.limit = limit
        self.block_size: int | None = None  # the engine's, from its first stored block

    def reset(self) -> None:
        self.keys.clear()

    def apply(self, events: Sequence[KVEvent]) -> list[CacheChange]:
        """The changes ``events`` make, one per stretch between two ``AllBlocksCleared``."""
        changes: list[CacheChange] = []
        # our key -> (held before this stretch, held at its end)
        state: dict[int, tuple[bool, bool]] = {}
        skipped = 0
        cleared = False

        def close() -> None:
            change = CacheChange(cleared=cleared, skipped=skipped)
            for key, (before, after) in state.items():
                if after:
                    change.stored.append(key)
                elif before:
                    change.removed.append(key)
            if not change.empty or skipped:
                changes.append(change)

        for ev in events:
            if type(ev) is BlockStored:
                skipped += self._stored(ev, state)
            elif type(ev) is BlockRemoved:
                for h in ev.block_hashes:
                    key = self.keys.pop(h, None)
                    if key is not None:
                        state[key] = (state.get(key, (True, True))[0], False)
            else:  # AllBlocksCleared
                close()
                self.keys.clear()
                state, skipped, cleared = {}, 0, True
        close()
        return changes

    def _stored(self, ev: BlockStored, state: dict[int, tuple[bool, bool]]) -> int:
        """Key the event's blocks; the count of blocks skipped."""
        n = len(ev.block_hashes)
        if ev.lora_name is not None or (ev.extra_keys and any(k for k in ev.extra_keys)):
            return n
        parent: int | None = None
        if ev.parent_block_hash is not None:
            parent = self.keys.get(ev.parent_block_hash)
            if parent is None:
                return n
        blocks = token_blocks(ev.token_ids, ev.block_size)
        if len(blocks) != n:
            return n  # not whole blocks of block_size: not a layout keyed here
        self.block_size = ev.block_size
        keys = self.keys
        for h, key in zip(ev.block_hashes, chain(blocks, parent), strict=True):
            held = keys.pop(h, None) is not None  # re-stored: now the newest entry
            keys[h] = key
            state[key] = (state.get(key, (held, held))[0], True)
        while len(keys) > self.limit:
            del keys[next(iter(keys))]
        return 0


def token_prefix(token_ids: Sequence[int], block_size: int) -> Prefix:
    """A prompt's keys as the engine's events name its blocks (its token ids, as the engine
    tokenizes the prompt, in blocks of the engine's ``block_size``)."""
    return Prefix(chain(token_blocks(token_ids, block_size)), block_size)
