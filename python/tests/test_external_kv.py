"""The external KV index from Python (issue 21, item 2): a scheduler-side script registers two
engine nodes through ``UMBPMasterClient``, reports the KV blocks each holds outside the pool, and
``match_external_kv`` routes a prompt's prefix to the node that holds it."""

from __future__ import annotations

import pytest

import sglang_harness
from conftest import free_port
from umbp._umbp import InvalidInputError, UMBPMasterClient
from umbp.mori import UMBPTierType

GiB = 1 << 30


def prefix_hashes(n: int, salt: str = "") -> list:
    """SGLang-style block hashes: hex digests, one per page of the prompt."""
    import hashlib

    return [hashlib.sha256(f"{salt}page-{i}".encode()).hexdigest() for i in range(n)]


def route(matches, prompt) -> tuple:
    """The node holding the longest run of the prompt's leading blocks, and its length."""
    best = ("", 0)
    for m in matches:
        held = {h for hashes in m.hashes_by_tier.values() for h in hashes}
        run = 0
        for h in prompt:
            if h not in held:
                break
            run += 1
        if run > best[1]:
            best = (m.node_id, run)
    return best


def test_a_scheduler_routes_a_prefix_to_the_node_that_holds_it(master):
    engine_a = UMBPMasterClient(master, node_id="engine-a", node_address="127.0.0.1")
    engine_b = UMBPMasterClient(master, node_id="engine-b", node_address="127.0.0.1")
    engine_a.register_self({UMBPTierType.HBM: (GiB, GiB)})
    engine_b.register_self()
    assert engine_a.is_registered() and engine_b.is_registered()

    prompt = prefix_hashes(16)
    # engine-a served this prompt before: its first 12 pages are in its HBM, 4 mirrored to DRAM.
    assert engine_a.report_external_kv_blocks("engine-a", prompt[:12], UMBPTierType.HBM)
    assert engine_a.report_external_kv_blocks("engine-a", prompt[:4], UMBPTierType.DRAM)
    # engine-b holds a shorter run of it, and another prompt.
    assert engine_b.report_external_kv_blocks("engine-b", prompt[:3], "dram")
    assert engine_b.report_external_kv_blocks("engine-b", prefix_hashes(8, salt="other"), 2)

    scheduler = UMBPMasterClient(master)
    matches = scheduler.match_external_kv(prompt, count_as_hit=True)
    assert [m.node_id for m in matches] == ["engine-a", "engine-b"]
    a = matches[0]
    assert list(a.hashes_by_tier) == [UMBPTierType.HBM, UMBPTierType.DRAM], "fastest tier first"
    assert a.hashes_by_tier[UMBPTierType.HBM] == prompt[:12]
    assert a.hashes_by_tier[UMBPTierType.DRAM] == prompt[:4]
    assert a.matched_hash_count() == 12, "a page on HBM and DRAM counts once"
    assert route(matches, prompt) == ("engine-a", 12)

    counts = {e.hash: e.hit_count_total for e in scheduler.get_external_kv_hit_counts(prompt)}
    assert counts == {h: 1 for h in prompt[:12]}, "one hit per matched page, none for misses"

    # engine-a's HBM is evicted, its DRAM mirror (4 pages) stays: still longer than engine-b's 3.
    engine_a.revoke_all_external_kv_blocks_at_tier("engine-a", UMBPTierType.HBM)
    assert route(scheduler.match_external_kv(prompt), prompt) == ("engine-a", 4)
    engine_a.revoke_external_kv_blocks("engine-a", prompt[:2], UMBPTierType.DRAM)
    assert route(scheduler.match_external_kv(prompt), prompt) == ("engine-b", 3)

    # A node that leaves takes its blocks along; reports for it are then ignored.
    engine_b.unregister_self()
    assert route(scheduler.match_external_kv(prompt), prompt) == ("", 0)
    assert scheduler.report_external_kv_blocks("engine-b", prompt, UMBPTierType.HBM) is False
    assert scheduler.match_external_kv([]) == []


def test_int_hashes_and_bad_input(master):
    node = UMBPMasterClient(master, node_id="ints")
    node.register_self()
    assert node.report_external_kv_blocks("ints", [1, 2, 3], UMBPTierType.SSD)
    [m] = node.match_external_kv(["1", 2, 99])
    assert m.hashes_by_tier == {int(UMBPTierType.SSD): ["1", "2"]}, "an int names the block of its digits"
    with pytest.raises(InvalidInputError):
        node.report_external_kv_blocks("ints", [], UMBPTierType.HBM)
    with pytest.raises(InvalidInputError):
        node.report_external_kv_blocks("", ["h"], UMBPTierType.HBM)
    with pytest.raises(InvalidInputError):
        node.report_external_kv_blocks("ints", ["h"], UMBPTierType.Unknown)
    with pytest.raises(InvalidInputError):
        node.report_external_kv_blocks("ints", [1.5], UMBPTierType.HBM)
    with pytest.raises(InvalidInputError, match="16384"):
        node.match_external_kv([str(i) for i in range(16385)])
    with pytest.raises(InvalidInputError):
        UMBPMasterClient(master).unregister_self()


def _engine(master: str, node_id: str):
    """An engine rank as SGLang makes one: a distributed ``mori.umbp`` client lending 16 MiB."""
    import umbp.mori as mu

    cfg = mu.UMBPConfig()
    cfg.dram.capacity_bytes = 16 << 20
    cfg.dram.prefault = False
    d = mu.UMBPDistributedConfig()
    d.master_config.master_address = master
    d.master_config.node_id = node_id
    d.master_config.node_address = "127.0.0.1"
    d.dram_page_size = 64 << 10
    cfg.distributed = d
    return mu.UMBPClient(cfg)


def _until(predicate, timeout: float = 10.0):
    import time

    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value or time.time() > deadline:
            return value
        time.sleep(0.05)


def test_engines_report_through_their_heartbeat_and_a_scheduler_routes(master):
    """The two-argument forms on each engine's own client ride its heartbeat (no RPC per block);
    the scheduler's match then routes a prompt to the engine holding the longest prefix."""
    import umbp.mori as mu

    a, b = _engine(master, "rank-a"), _engine(master, "rank-b")
    try:
        prompt = prefix_hashes(10, salt="hb")
        assert a.report_external_kv_blocks(prompt[:8], mu.UMBPTierType.HBM)
        assert b.report_external_kv_blocks(prompt[:5], mu.UMBPTierType.HBM)
        assert b.report_external_kv_blocks(prompt[:6], "dram")
        scheduler = mu.UMBPMasterClient(master)
        assert mu.UMBPMasterClient is UMBPMasterClient, "mori.umbp exports the master client"

        def routed():
            m = scheduler.match_external_kv(prompt)
            return route(m, prompt) if len(m) == 2 else None

        assert _until(lambda: routed() == ("rank-a", 8)), routed()
        # The engine's own client can ask too.
        assert [m.node_id for m in b.match_external_kv(prompt)] == ["rank-a", "rank-b"]
        # rank-a's HBM is wiped: rank-b's six DRAM pages win.
        assert a.revoke_all_external_kv_blocks_at_tier(mu.UMBPTierType.HBM)
        assert _until(lambda: routed() is None and route(scheduler.match_external_kv(prompt), prompt) == ("rank-b", 6))
        assert b.revoke_external_kv_blocks(prompt[:6], mu.UMBPTierType.DRAM)
        assert _until(lambda: route(scheduler.match_external_kv(prompt), prompt) == ("rank-b", 5))
        # Bad input answers False, never raises.
        assert a.report_external_kv_blocks([], mu.UMBPTierType.HBM) is False
        assert a.report_external_kv_blocks(prompt, "nvme") is False
    finally:
        a.close()
        b.close()
    # Engines that leave take their blocks along.
    assert _until(lambda: scheduler.match_external_kv(prompt) == [], timeout=15.0)


@pytest.fixture(scope="module")
def kv_events():
    """SGLang's ``umbp_store`` (its ``KVEventsSubscriber``) and ``kv_events`` modules, unmodified."""
    d = sglang_harness.fetch_or_skip()
    store, _ = sglang_harness.import_store(d)
    return store, sglang_harness.import_kv_events(d)


def test_sglangs_kv_event_subscriber_reports_an_engines_blocks(master, kv_events):
    """SGLang's own ``KVEventsSubscriber`` thread, fed SGLang's ``KVEventBatch`` wire format over a
    real ZMQ socket (as its engine publishes them), reports, revokes and clears this engine's blocks
    through our ``mori.umbp`` client; a scheduler's match sees each change."""
    import time

    import msgspec
    import zmq

    store, ev = kv_events
    engine = _engine(master, "rank-events")
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    subscriber = store.KVEventsSubscriber(engine, endpoint=f"tcp://127.0.0.1:{port}", topic="", poll_timeout_ms=20)
    subscriber.start()
    scheduler = UMBPMasterClient(master)
    encoder = msgspec.msgpack.Encoder()
    seq = [0]

    def publish(*events):
        # The publisher's frames: topic, sequence number, the msgpack batch.
        seq[0] += 1
        batch = ev.KVEventBatch(ts=time.time(), events=list(events))
        pub.send_multipart([b"", seq[0].to_bytes(8, "big"), encoder.encode(batch)])

    def held(hashes):
        """``{tier: [hash, ...]}`` the master holds for this engine."""
        for m in scheduler.match_external_kv(hashes):
            if m.node_id == "rank-events":
                return m.hashes_by_tier
        return {}

    def until_held(events, hashes, expected, timeout=10.0):
        # PUB/SUB drops what is sent before the subscription arrives: publish again until seen
        # (each change is idempotent).
        deadline = time.time() + timeout
        while held(hashes) != expected:
            assert time.time() < deadline, f"after {events}: {held(hashes)}"
            publish(*events)
            time.sleep(0.1)

    blocks = [1001, 1002, -1003, 2**62]
    names = [str(h) for h in blocks]
    try:
        gpu = ev.StorageMedium.GPU.value
        cpu = ev.StorageMedium.CPU.value
        stored = ev.BlockStored(
            block_hashes=blocks, parent_block_hash=None, token_ids=[1, 2, 3], block_size=16, lora_id=None, medium=gpu
        )
        until_held([stored], names, {UMBPTierType.HBM: names})
        mirrored = ev.BlockStored(
            block_hashes=blocks[:2], parent_block_hash=None, token_ids=[1], block_size=16, lora_id=None, medium=cpu
        )
        until_held([mirrored], names, {UMBPTierType.HBM: names, UMBPTierType.DRAM: names[:2]})
        removed = ev.BlockRemoved(block_hashes=blocks[1:3], medium=gpu)
        until_held([removed], names, {UMBPTierType.HBM: [names[0], names[3]], UMBPTierType.DRAM: names[:2]})
        until_held([ev.AllBlocksCleared()], names, {})
    finally:
        subscriber.stop()
        pub.close(linger=0)
        engine.close()
