"""Lower chunk tiers (chunkcache/chunk/tiers/): the entry format, the disk tier, the Redis tier,
and an engine that finds its documents there after a restart or on another replica."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.tiers.disk import DiskTier
from chunkcache.chunk.tiers.provider import CorruptEntry, StoredKV, decode, encode, tier_key
from chunkcache.chunk.tiers.remote import RedisTier
from chunkcache.chunk.tiers.stack import TierStack
from chunkcache.cli import main as cli_main
from chunkcache.config import EngineConfig
from chunkcache.errors import InvalidRequestError
from chunkcache.hashing import chunk_hash
from tests.support.engines import tiny_llm
from tests.support.prompts import ALICE, BOB, CAROL, QUESTION, RIVER, SYSTEM, ZORVAK, chunked
from tests.support.redis_server import RedisServer

DOCS = [ALICE, BOB, CAROL, RIVER, ZORVAK]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


_llm = partial(tiny_llm, chunk_layout="isolated", kv_cache_tokens=1024)


def _prompt(doc_ids: list[int], question: str = QUESTION) -> str:
    return chunked(SYSTEM, [DOCS[i] for i in doc_ids], question)


def _chunk_tokens(llm: LLM, doc_ids: list[int]) -> int:
    return sum(len(llm.tokenizer.encode(DOCS[i], add_special_tokens=False)) for i in doc_ids)


def _same(a, b) -> None:
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit-for-bit: the KV is the same


def _kv(tokens: int = 5, model: str = "m" * 64) -> StoredKV:
    g = torch.Generator().manual_seed(tokens)
    k, v = torch.randn(2, tokens, 2, 4, generator=g), torch.randn(2, tokens, 2, 4, generator=g)
    return StoredKV(model, bytes(range(32)), "chunk", ((1, 2), tuple(range(tokens))), k, v)


def test_tier_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"chunk_cache_remote must be a redis://host:port/db URL"):
        EngineConfig.from_options("m", use_env=False, chunk_cache_remote="http://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="chunk_cache_disk_gb must be > 0"):
        EngineConfig.from_options("m", use_env=False, chunk_cache_disk_gb=0.0)
    config = EngineConfig.from_options("m", use_env=False, chunk_cache_disk_dir="/d", chunk_cache_disk_gb=2)
    assert config.chunk.disk_dir == "/d" and config.chunk.disk_gb == 2


# ---- the entry format ----------------------------------------------------------------------------


def test_entry_roundtrip_and_corruption_detected() -> None:
    kv = _kv()
    blob = encode(kv)
    back = decode(blob)
    assert back.token_ids == kv.token_ids and back.key == kv.key and back.model == kv.model
    assert torch.equal(back.k, kv.k) and torch.equal(back.v, kv.v)
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40  # a bit in the last tensor's data
    with pytest.raises(CorruptEntry, match="checksum"):
        decode(bytes(flipped))
    with pytest.raises(CorruptEntry):
        decode(blob[: len(blob) - 10])
    with pytest.raises(CorruptEntry):
        decode(b"")
    # An entry that measured its sensitivity keeps it, under the same checksum.
    kv.sensitivity = torch.rand(kv.num_tokens)
    back = decode(encode(kv))
    assert back.sensitivity is not None and torch.equal(back.sensitivity, kv.sensitivity)
    assert decode(encode(_kv())).sensitivity is None


# ---- the disk tier -------------------------------------------------------------------------------


def _name(letter: str) -> str:
    """A disk-tier entry name (a tier key), told apart by `letter`."""
    return tier_key("m" * 64, letter.encode() * 32, 5)


def test_disk_tier_lru_budget_restart_and_too_large(tmp_path: Path) -> None:
    blob = encode(_kv())
    a, b, c, d = map(_name, "abcd")
    tier = DiskTier(str(tmp_path), budget_bytes=3 * len(blob) + 10)
    for name in (a, b, c):
        assert tier.store(name, blob)
    assert tier.load(a) == blob  # "a" is now the most recently used
    assert tier.store(d, blob)  # over budget: "b", the least recently used, goes
    assert sorted(tier.names()) == sorted([a, c, d]) and not (tmp_path / f"{b}.safetensors").exists()
    tier.check_integrity()
    assert not tier.store(_name("h"), b"x" * (4 * len(blob)))
    assert tier.stats()["too_large"] == 1
    (tmp_path / "e.123.tmp").write_bytes(b"half a write")
    again = DiskTier(str(tmp_path), budget_bytes=2 * len(blob) + 10)  # restart with a smaller budget
    assert len(again.names()) == 2 and c not in again.names()  # LRU order survived the restart
    assert not (tmp_path / "e.123.tmp").exists()
    again.check_integrity()


def test_disk_full_stops_writing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(str(tmp_path), budget_bytes=1 << 20)

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("chunkcache.chunk.tiers.disk.os.replace", no_space)
    with caplog.at_level(logging.ERROR):
        assert not tier.store(_name("a"), b"data")
    assert "stops writing" in caplog.text
    monkeypatch.undo()
    assert not tier.store(_name("b"), b"data")  # stopped, even now that there would be room
    assert tier.stats()["writes_stopped"] == 1 and tier.stats()["entries"] == 0
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


# ---- the engine over a disk directory -------------------------------------------------------------


def test_restart_loads_documents_from_disk(checkpoint, tmp_path: Path) -> None:
    path = checkpoint(arch="qwen3")
    disk = str(tmp_path / "kv")
    with _llm(path, chunk_cache_disk_dir=disk) as first:
        cold = first.generate(_prompt([0, 1, 2]), GREEDY)[0]
        assert cold.num_chunk_cached_tokens == 0
        first.engine.flush_chunk_tiers()
        stats = first.chunk_cache_stats()["tiers"]["disk"]
        assert stats["entries"] == 4 and stats["stores"] == 4  # S and three chunks
    with _llm(path, chunk_cache_disk_dir=disk) as second:
        warm = second.generate(_prompt([2, 0, 1]), GREEDY)[0]
        assert warm.num_chunk_cached_tokens == _chunk_tokens(second, [0, 1, 2])
        assert warm.num_prefix_cached_tokens == len(second.tokenizer.encode(SYSTEM))
        again = second.generate(_prompt([0, 1, 2]), GREEDY)[0]
        _same(cold, again)
        tiers = second.chunk_cache_stats()["tiers"]["disk"]
        assert tiers["hits"] == 4 and tiers["misses"] == 0 and tiers["corrupt"] == 0
        assert sum(tiers["load_seconds_buckets"]) == 4
        assert second.engine.reset_chunk_cache() == 4 and second.chunk_cache_stats()["entries"] == 0
        _same(cold, second.generate(_prompt([0, 1, 2]), GREEDY)[0])  # from the disk again
        assert second.chunk_cache_stats()["tiers"]["disk"]["hits"] == 8
        second.check_integrity()


def test_a_measured_sensitivity_is_written_down_and_loaded_with_the_kv(
    checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry measures its sensitivity after it was written down (the first request that ranks
    by it): the tier's copy is rewritten with it, so that another engine loading the entry ranks
    by the same scores without measuring them again."""
    import chunkcache.engine.runner as runner

    calls: list[int] = []
    real = runner.measure
    monkeypatch.setattr(runner, "measure", lambda *a: calls.append(1) or real(*a))
    path = checkpoint(arch="llama", num_hidden_layers=3)
    disk = str(tmp_path / "kv")
    stored = {
        "chunk_layout": "offset",
        "blend_check_layers": [0],
        "blend_recompute_ratios": [0.3],
        "blend_selector": "stored_deviation",
    }
    with _llm(path, chunk_cache_disk_dir=disk, enable_prefix_caching=False) as first:
        cold = first.generate(_prompt([0, 1, 2]), GREEDY, chunk_options=stored)[0]
        assert len(calls) == 1  # one pass for the three documents
        first.engine.flush_chunk_tiers()
        scores = {e.key: e.sensitivity for e in first.engine.chunks.pool.entries() if e.kind == "chunk"}
        assert first.chunk_cache_stats()["tiers"]["disk"]["stores"] == 4 + 3  # then rewritten
    with _llm(path, chunk_cache_disk_dir=disk, enable_prefix_caching=False) as second:
        warm = second.generate(_prompt([0, 1, 2]), GREEDY, chunk_options=stored)[0]
        assert warm.num_chunk_cached_tokens > 0 and len(calls) == 1
        for entry in second.engine.chunks.pool.entries():
            if entry.kind == "chunk":
                assert torch.equal(entry.sensitivity, scores[entry.key])
        _same(cold, warm)
        second.check_integrity()
    # A prewarm under an engine that ranks by them measures them too: "warm" means ready to rank by.
    engine_wide = {"blend_selector": "stored_deviation", "blend_check_layers": [0]}
    with _llm(path, chunk_layout="offset", enable_prefix_caching=False, **engine_wide) as third:
        third.prewarm([{"prompt": _prompt([3, 4])}])
        assert len(calls) == 2
        third.generate(_prompt([3, 4]), GREEDY)
        assert len(calls) == 2
        third.check_integrity()


def test_corrupt_and_truncated_files_are_recomputed(checkpoint, tmp_path: Path) -> None:
    path = checkpoint(arch="qwen3")
    disk = tmp_path / "kv"
    with _llm(path, chunk_cache_disk_dir=str(disk)) as first:
        cold = first.generate(_prompt([0, 1]), GREEDY)[0]
    files = sorted(disk.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    assert len(files) == 3
    flipped = bytearray(files[-1].read_bytes())
    flipped[-5] ^= 0x01
    files[-1].write_bytes(bytes(flipped))
    files[-2].write_bytes(files[-2].read_bytes()[:100])
    with _llm(path, chunk_cache_disk_dir=str(disk)) as second:
        warm = second.generate(_prompt([0, 1]), GREEDY)[0]
        _same(cold, warm)
        second.engine.flush_chunk_tiers()
        disk_stats = second.chunk_cache_stats()["tiers"]["disk"]
        assert disk_stats["corrupt"] == 2 and disk_stats["hits"] == 1
        assert disk_stats["stores"] == 2  # recomputed and written again
        second.check_integrity()
    for f in files:
        decode(f.read_bytes())  # every file sound again


def test_another_model_never_loads_these_entries(checkpoint, tmp_path: Path) -> None:
    disk = str(tmp_path / "kv")
    # Same architecture, tokenizer and served name; other weights.
    with _llm(checkpoint(arch="qwen3"), chunk_cache_disk_dir=disk, served_model_name="m") as first:
        first.generate(_prompt([0]), GREEDY)
    with _llm(checkpoint(arch="qwen3", seed=1), chunk_cache_disk_dir=disk, served_model_name="m") as other:
        out = other.generate(_prompt([0]), GREEDY)[0]
        assert out.num_chunk_cached_tokens == 0 and out.num_prefix_cached_tokens == 0
        assert other.chunk_cache_stats()["tiers"]["disk"]["hits"] == 0


def test_pool_eviction_demotes_what_the_tiers_lack(checkpoint, tmp_path: Path) -> None:
    path = checkpoint(arch="qwen3")
    disk = tmp_path / "kv"
    # A pool of 8 pages (of 16 tokens): every new document evicts older ones.
    page = 16 * 2 * 2 * 2 * 16 * 4
    with _llm(path, chunk_cache_disk_dir=str(disk), chunk_cache_size_gb=8 * page / 2**30) as llm:
        tiers = llm.engine.chunks.tiers
        limit = tiers.max_pending_bytes
        tiers.max_pending_bytes = 0  # every write-through is dropped ...
        llm.generate(_prompt([0]), GREEDY)
        assert tiers.dropped_writes == 2 and not list(disk.glob("*.safetensors"))
        tiers.max_pending_bytes = limit  # ... so evicting those entries must write them down
        for i in (1, 2, 3, 4):
            llm.generate(_prompt([i]), GREEDY)
        assert llm.chunk_cache_stats()["evictions"] > 0
        llm.engine.flush_chunk_tiers()
        # Documents 1-4 were written through; document 0 only by its eviction (S stays in the pool).
        assert llm.chunk_cache_stats()["tiers"]["disk"]["entries"] == 5
        tok = llm.tokenizer
        doc0 = tok.encode(DOCS[0], add_special_tokens=False)
        key = chunk_hash(llm.engine.model_name, tok.encode(SYSTEM), doc0)
        assert (disk / f"{tier_key(tiers.model, key, len(doc0))}.safetensors").is_file()
        llm.check_integrity()


# ---- the Redis tier ----------------------------------------------------------------------------


def test_redis_tier_splits_large_values(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, prefix="t:", part_bytes=1000)
    blob = encode(_kv(tokens=40))
    assert len(blob) > 2000 and tier.store("e", blob)
    assert tier.load("e") == blob and tier.contains("e")
    client = tier._client
    parts = -(-len(blob) // 1000)
    assert client.exists(*[f"t:e:{i}" for i in range(parts)]) == parts
    client.delete("t:e:1")  # as Redis's own LRU could
    assert tier.load("e") is None and tier.stats()["partial"] == 1
    assert not tier.contains("e")  # the rest is gone too
    tier.close()


def test_two_replicas_share_redis_and_survive_it_dying(checkpoint, redis_server: RedisServer) -> None:
    path = checkpoint(arch="qwen3")
    with (
        _llm(path, chunk_cache_remote=redis_server.url) as first,
        _llm(path, chunk_cache_remote=redis_server.url) as second,
    ):
        cold = first.generate(_prompt([3, 4]), GREEDY)[0]
        first.engine.flush_chunk_tiers()
        warm = second.generate(_prompt([3, 4]), GREEDY)[0]
        assert warm.num_chunk_cached_tokens == _chunk_tokens(second, [3, 4])
        _same(cold, warm)
        assert second.chunk_cache_stats()["tiers"]["remote"]["hits"] == 3
        redis_server.stop()
        down = second.generate(_prompt([0, 1]), GREEDY)[0]  # computed; no error reaches us
        assert down.outputs[0].finish_reason == "length" and down.error is None
        second.engine.flush_chunk_tiers()
        remote = second.chunk_cache_stats()["tiers"]["remote"]
        assert remote["unavailable"] > 0 and remote["up"] == 0
        second.check_integrity()


# ---- prewarming ----------------------------------------------------------------------------------


def test_prewarm_fills_the_pool_without_generating(checkpoint) -> None:
    path = checkpoint(arch="qwen3")
    with _llm(path) as cold_llm:
        cold = cold_llm.generate(_prompt([1, 2]), GREEDY)[0]
    with _llm(path) as llm:
        items = [{"system": SYSTEM, "documents": [DOCS[1], DOCS[2]]}, {"prompt": _prompt([2, 3])}]
        first, second = llm.prewarm(items, window=1)  # one at a time: the second finds doc 2 done
        assert first.outputs[0].token_ids == [] and first.error is None
        assert first.num_cached_tokens == 0 and second.num_chunk_cached_tokens == _chunk_tokens(llm, [2])
        assert second.num_computed_tokens == _chunk_tokens(llm, [3])  # the question is not computed
        warm = llm.generate(_prompt([1, 2]), GREEDY)[0]
        assert warm.num_chunk_cached_tokens == _chunk_tokens(llm, [1, 2])
        _same(cold, warm)
        with pytest.raises(InvalidRequestError, match=r"item 0: .*not both"):
            llm.prewarm([{"prompt": _prompt([0]), "system": SYSTEM}])
        with pytest.raises(InvalidRequestError, match="not a chunked prompt"):
            llm.prewarm([{"system": SYSTEM, "documents": [DOCS[0]]}, {"prompt": "no separators"}])
        with pytest.raises(InvalidRequestError, match="unknown fields"):
            llm.prewarm([{"documents": [DOCS[0]], "question": "?"}])
        stats = llm.engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0
        llm.check_integrity()


def test_cli_prewarm_fills_the_disk_tier(checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = checkpoint(arch="qwen3")
    items = tmp_path / "docs.jsonl"
    items.write_text(
        json.dumps({"system": SYSTEM, "documents": DOCS[:3]})
        + "\n\n"
        + json.dumps({"prompt": _prompt([3, 4])})
    )
    disk = str(tmp_path / "kv")
    options = [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--chunk-layout",
        "isolated",
        "--kv-cache-tokens",
        "1024",
    ]
    argv = ["prewarm", "--model", str(path), "--documents", str(items), *options]
    assert cli_main([*argv, "--chunk-cache-disk-dir", disk]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["items"] == 2 and summary["failed"] == 0 and summary["tiers"]["disk"]["entries"] == 6
    with _llm(path, chunk_cache_disk_dir=disk) as llm:
        out = llm.generate(_prompt([4, 0, 2]), GREEDY)[0]
        assert out.num_chunk_cached_tokens == _chunk_tokens(llm, [4, 0, 2])
    # A usage error is one line on stderr and exit status 2 (errors.run_command), not a traceback.
    capsys.readouterr()
    assert cli_main(argv) == 2
    assert "prewarm needs a tier" in capsys.readouterr().err


def test_a_process_that_never_closes_its_engine_still_writes_its_entries(checkpoint, tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    script = (
        "import sys, time; from chunkcache import LLM, SamplingParams\n"
        "from chunkcache.chunk.tiers.disk import DiskTier\n"
        "store = DiskTier.store\n"  # a slow disk: the writes are still pending at exit
        "DiskTier.store = lambda self, key, blob: time.sleep(0.3) or store(self, key, blob)\n"
        "llm = LLM(sys.argv[1], device='cpu', dtype='float32', chunk_layout='isolated', kv_cache_tokens=1024,\n"
        "          chunk_cache_size_gb=0.001, chunk_cache_disk_dir=sys.argv[2])\n"
        "llm.generate(sys.argv[3], SamplingParams(max_tokens=1))\n"  # and exit, no close()
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", script, str(checkpoint(arch="qwen3")), str(disk), _prompt([0, 1])]
    subprocess.run(cmd, env=env, check=True, timeout=120, capture_output=True)
    assert len(list(disk.glob("*.safetensors"))) == 3


def test_unreadable_disk_dir_is_a_clear_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="is not a readable directory"):
        DiskTier(str(not_a_dir / "kv"), budget_bytes=1 << 20)


def _read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the disk tier's directory behave as a read-only file system (EROFS on every change);
    tests run as root, for whom permission bits do not stop writes."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    real_open = open

    def open_read_only(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if any(m in mode for m in "wax+"):
            refuse()
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("chunkcache.chunk.tiers.disk.open", open_read_only, raising=False)
    for name in ("replace", "utime"):
        monkeypatch.setattr(f"chunkcache.chunk.tiers.disk.os.{name}", refuse)
    monkeypatch.setattr(Path, "unlink", refuse)


def test_read_only_directory_is_served_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: a read-only directory refused to start the server; one that turned read-only
    failed every read (touching the file), raised out of evictions and counted nothing."""
    kv, other = _kv(5), _kv(6)
    stack = TierStack([DiskTier(str(tmp_path), budget_bytes=len(encode(other)) + 10)], kv.model)
    try:
        stack.store(kv)
        stack.flush()
        _read_only(monkeypatch)  # turns read-only at run time
        stack.store(other)  # over budget: the eviction and the write both fail, and are counted
        stack.flush()
        stats = stack.stats()["disk"]
        assert stats["writes_stopped"] == 1 and stats["write_errors"] == 2 and stats["store_failures"] == 1
        assert stack.load(kv.key, kv.token_ids) is not None  # still served (its file could not go)
        assert stack.stats()["disk"]["read_errors"] == 0
        stack.check_integrity()
    finally:
        stack.close()
    started = DiskTier(str(tmp_path), budget_bytes=1 << 20)  # read-only from start-up: it starts
    assert started.stats()["writes_stopped"] == 1 and started.stats()["entries"] == 1
    blob = started.load(tier_key(kv.model, kv.key, 5))
    assert blob is not None and torch.equal(decode(blob).k, kv.k)
    assert not started.store(_name("z"), b"data")


def test_misnamed_entries_are_deleted_and_rewritten(tmp_path: Path) -> None:
    kv, other = _kv(5), _kv(6)
    stack = TierStack([DiskTier(str(tmp_path), budget_bytes=1 << 20)], kv.model)
    try:
        stack.store(kv)
        stack.flush()
        wrong = tmp_path / f"{tier_key(other.model, other.key, 6)}.safetensors"
        wrong.write_bytes((tmp_path / f"{tier_key(kv.model, kv.key, 5)}.safetensors").read_bytes())
        assert stack.load(other.key, other.token_ids) is None
        assert stack.stats()["disk"]["misnamed"] == 1 and not wrong.exists()
        stack.store(other)
        stack.flush()
        got = stack.load(other.key, other.token_ids)
        assert got is not None and torch.equal(got[0].k, other.k)
    finally:
        stack.close()


def test_junk_files_and_symlinks_are_not_entries(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "secret.safetensors"
    target.write_bytes(encode(_kv()))
    disk = tmp_path / "kv"
    disk.mkdir()
    (disk / "notes.txt").write_text("not an entry")
    (disk / "junk.safetensors").write_bytes(b"junk")
    (disk / f"{_name('d')}.safetensors").mkdir()
    link = _name("l")
    (disk / f"{link}.safetensors").symlink_to(target)
    tier = DiskTier(str(disk), budget_bytes=1 << 20)
    assert tier.stats()["entries"] == 0 and tier.names() == []
    assert not tier.contains(link) and tier.load(link) is None  # never follows the link
    assert tier.stats()["read_errors"] == 1
    assert target.exists() and (disk / "notes.txt").exists()


def test_a_failed_write_leaves_the_entry_to_be_demoted_again(tmp_path: Path) -> None:
    kv = _kv()
    stack = TierStack([DiskTier(str(tmp_path), budget_bytes=10)], kv.model)  # too small for any entry
    try:
        stack.store(kv)
        assert stack.holds(kv.key)  # queued
        stack.flush()
        assert not stack.holds(kv.key) and stack.counters["DISK"].store_failures == 1
        assert stack.load(kv.key, kv.token_ids) is None
    finally:
        stack.close()


def test_a_slow_tier_load_stalls_no_other_request(
    checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint(arch="qwen3")
    disk = str(tmp_path / "kv")
    with _llm(path, chunk_cache_disk_dir=disk) as first:
        cold = first.generate(_prompt([0, 1]), GREEDY)[0]
        first.generate(_prompt([2]), GREEDY)
    release = threading.Event()
    load = DiskTier.load

    def held_back(self: DiskTier, key: str) -> bytes | None:
        assert release.wait(30), "the test never released the load"
        return load(self, key)

    monkeypatch.setattr(DiskTier, "load", held_back)
    with _llm(path, chunk_cache_disk_dir=disk) as llm:
        engine = llm.engine
        done: dict[str, object] = {}

        def step_until(cond) -> None:
            while not cond():
                done.update({o.request_id: o for o in engine.step() if o.finished})

        engine.add_request("chunked", _prompt([0, 1]), GREEDY)
        engine.add_request("plain", "Hello there", SamplingParams(max_tokens=3, ignore_eos=True))
        step_until(lambda: "plain" in done)
        assert "chunked" not in done  # its documents are still being read; the other went on
        engine.add_request("given-up", _prompt([2]), GREEDY)
        engine.step()
        engine.abort_request("given-up")  # while its document loads
        release.set()
        step_until(lambda: not engine.has_unfinished_requests())
        warm = done["chunked"]
        assert warm.num_chunk_cached_tokens == _chunk_tokens(llm, [0, 1])
        assert warm.num_prefix_cached_tokens == len(llm.tokenizer.encode(SYSTEM))
        _same(cold, warm)
        assert done["given-up"].outputs[0].finish_reason == "abort"
        assert engine.chunks.loads_pending == 0
        # The abandoned load still landed: document 2 is in the pool now, ready for the next one.
        again = llm.generate(_prompt([2]), GREEDY)[0]
        assert again.num_chunk_cached_tokens == _chunk_tokens(llm, [2])
        assert llm.chunk_cache_stats()["tiers"]["disk"]["hits"] == 4
        llm.check_integrity()


def test_an_entry_of_another_kv_layout_is_a_miss(tmp_path: Path) -> None:
    kv = _kv()  # [2 layers, 5 tokens, 2 heads, 4 dims], float32
    for layout, hit in (
        ((2, 2, 4, torch.float32), True),
        ((3, 2, 4, torch.float32), False),
        ((2, 2, 4, torch.float16), False),
    ):
        stack = TierStack([DiskTier(str(tmp_path), budget_bytes=1 << 20)], kv.model, layout)
        try:
            stack.store(kv)
            stack.flush()
            assert (stack.load(kv.key, kv.token_ids) is not None) == hit
            assert stack.load(kv.key, ((1, 2), (9,) * 5)) is None  # other tokens, same key: never
        finally:
            stack.close()
