"""Tier 1 for what the driver shows and keeps: rank lists, the sink's lines, progress, redaction."""

from __future__ import annotations

import pytest

from launcher.core.outbatch import STDERR, STDOUT, Held, OutputBatch, Source, batch_bytes, merged, send_every
from launcher.core.progress import TrainingFacts, parse_megatron_line
from launcher.core.rankenv import decide_env, redact
from launcher.core.straggler import WaitSample
from launcher.core.topology import parse_rank_list
from launcher.driver.output.progress_view import ProgressView
from launcher.driver.output.sink import OutputSink

# One line of Megatron-Bridge's training log (training/utils/train_utils.py, training_log)
BRIDGE_LINE = (
    " [2026-11-22 13:00:00] iteration       40/     100 | consumed samples:          320 | elapsed time "
    "per iteration (ms): 480.2 | throughput per GPU (TFLOP/s/GPU): 402.1 | learning rate: 3.000000E-04 |"
    " global batch size:     8 | lm loss: 1.331000E+00 | loss scale: 1.0 | grad norm: 0.812 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |"
)


@pytest.mark.parametrize(
    "text, world, ranks",
    [("0", 4, {0}), ("all", 3, {0, 1, 2}), ("0,3,8-10", 16, {0, 3, 8, 9, 10}), ("ALL", 1, {0})],
)
def test_rank_lists(text, world, ranks):
    assert parse_rank_list(text, world) == ranks


@pytest.mark.parametrize("text", ["4", "x", "2-1", "1-", "-1"])
def test_bad_rank_lists_say_why(text):
    with pytest.raises(ValueError, match="--log-ranks"):
        parse_rank_list(text, 4)


def test_the_sink_prefixes_lines_keeps_partial_ones_and_picks_console_ranks(tmp_path):
    sink = OutputSink(str(tmp_path), node_of_rank=[0, 0, 1, 1], console=frozenset({0}))
    sent: dict[Source, int] = {}

    def write(rank: int, text: str, stream: int = STDOUT) -> None:
        data, source = text.encode(), Source(rank, stream)
        sink.write(source, data, sent.get(source, 0))
        sent[source] = sent.get(source, 0) + len(data)

    write(2, "first line\nhalf a ")
    write(0, "rank zero\n")
    write(0, "a warning, half", STDERR)  # each stream's partial line is its own
    write(0, " of it\n", STDERR)
    write(2, "line\n" + BRIDGE_LINE + "\n")
    write(3, "no newline at the end")
    console, progress, writes = sink.drain()
    assert writes == 6
    # each line with its stream: a rank's stderr goes to the launcher's stderr (#45 item 2)
    assert console == [(STDOUT, "[r0 n0] rank zero"), (STDERR, "[r0 n0] a warning, half of it")]
    assert [(p["rank"], p["iteration"], p["total"], p["loss"]) for p in progress] == [(2, 40, 100, 1.331)]
    assert sink.drain() == ([], [], 6)
    sink.finish()
    assert (tmp_path / "rank-2.log").read_text().splitlines()[:2] == [
        "[r2 n1] first line",
        "[r2 n1] half a line",
    ]
    assert (tmp_path / "rank-3.log").read_text() == "[r3 n1] no newline at the end\n"
    assert (tmp_path / "rank-3.log").stat().st_mode & 0o777 == 0o600  # rank output can hold secrets


def test_the_sink_writes_what_the_rank_and_a_salvage_both_sent_once(tmp_path):
    """A dead rank's spool is shipped from its node while the rank's own last message may still be
    on its way: bytes arrive by offset, overlapping, repeated, or with a gap (a long spool's end)."""
    sink = OutputSink(str(tmp_path), node_of_rank=[0], console=frozenset({0}))
    spool = "step 1\nstep 2\nlast w\u00f6rds before os._exit\n".encode()
    out, err = Source(0, STDOUT), Source(0, STDERR)
    sink.write(out, spool[:10], 0)
    sink.write(out, spool[4:], 4)  # the salvage, from an older offset
    sink.write(out, spool[10:20], 10)  # the rank's own message, arriving late
    assert sink.received_bytes(out) == len(spool) and sink.received_of([out, err]) == [len(spool), 0]
    assert sink.tail(0) == ["step 1", "step 2", "last w\u00f6rds before os._exit"]
    sink.write(err, b"Traceback (most recent call last):\n  File", 0)  # the stderr spool: its own offsets
    assert sink.tail(0)[-2:] == ["Traceback (most recent call last):", "  File"]
    sink.write(out, b"end\n", len(spool) + 100)
    gap = "[megaray: 100 bytes of this rank's output were not received]"
    assert sink.tail(0)[-3:] == [gap, "end", "  File"]  # a stream's unterminated line comes last
    sink.finish()
    assert (tmp_path / "rank-0.log").read_text().count("step 2") == 1


def test_megatron_log_line_is_parsed():
    record = parse_megatron_line(BRIDGE_LINE)
    assert record["iteration"] == 40 and record["total"] == 100
    assert record["iter_s"] == pytest.approx(0.4802) and record["global_batch"] == 8
    assert record["loss"] == pytest.approx(1.331)
    assert parse_megatron_line("iteration 3 of my own loop") is None


def test_progress_figures_from_megatron_facts():
    # Llama3-8B, sequence 8192, global batch 512 on 64 GPUs at 10 s per iteration
    facts = TrainingFacts(seq_length=8192, global_batch=512, train_iters=1000, flops_per_token=51.47e9)
    view = ProgressView(facts, world_size=64, peak_tflops=989.0, tty=False)
    view.update({"iteration": 100, "total": 1000, "iter_s": 10.0, "loss": 2.5, "time": 0.0})
    s = view.stats
    assert s["tokens_per_s"] == pytest.approx(512 * 8192 / 10)
    assert s["tflops_per_gpu"] == pytest.approx(51.47e9 * 512 * 8192 / 10 / 64 / 1e12)
    assert s["mfu"] == pytest.approx(s["tflops_per_gpu"] / 989.0)
    assert s["eta_s"] == pytest.approx(9000)
    line = view.describe()
    assert line.startswith(
        "iteration 100/1000 | loss 2.5 | 419.4k tokens/s | 337.3 TFLOP/s/GPU (34.1% MFU of 989)"
    )
    assert line.endswith("ETA 2h30m")


def test_progress_from_report_calls_derives_the_rate():
    view = ProgressView(TrainingFacts(), world_size=2, peak_tflops=989.0, tty=False)
    view.update({"iteration": 1, "total": 11, "tokens": 4096, "time": 100.0})
    view.update({"iteration": 3, "total": 11, "tokens": 4096, "time": 101.0})
    assert view.stats["iter_s"] == pytest.approx(0.5)
    assert view.stats["tokens_per_s"] == pytest.approx(8192)
    assert view.stats["eta_s"] == pytest.approx(4.0)
    assert "TFLOP" not in view.describe()  # no formula for a plain program


def test_a_relaunch_times_its_own_iterations_and_says_which_restart_it_is():
    from launcher.core.lifecycle import LaunchState

    view = ProgressView(TrainingFacts(), world_size=2, peak_tflops=989.0, tty=False)
    view.update({"iteration": 1, "total": 11, "time": 100.0})
    view.update({"iteration": 3, "total": 11, "time": 101.0})
    view.on_state(LaunchState.RUNNING)
    assert view.restarts == 0 and "restart" not in view.describe()
    view.on_state(LaunchState.RESTARTING)  # the relaunch resumes at iteration 2, 60 s later
    view.update({"iteration": 2, "total": 11, "time": 161.0})
    assert "iter_s" not in view.stats  # no rate from (161-101)/(2-3) across the restart
    view.update({"iteration": 4, "total": 11, "time": 162.0})
    assert view.stats["iter_s"] == pytest.approx(0.5)
    assert view.describe().endswith("| restart 1")


def test_secrets_are_redacted_in_env_notes_and_records():
    env = {
        "HF_TOKEN": "abc",
        "WANDB_API_KEY": "k",
        "DB_PASSWORD": "p",
        "AWS_SECRET_ACCESS_KEY": "s",
        "PATH": "/b",
    }
    assert redact(env) == {k: ("/b" if k == "PATH" else "<redacted>") for k in env}
    decision = decide_env({}, node_env={"HF_TOKEN": "old-secret"}, profile={}, profile_name=None,
                          overrides={"HF_TOKEN": "new-secret"})  # fmt: skip
    assert decision.to_set["HF_TOKEN"] == "new-secret"
    assert decision.notes and not any("secret" in n for n in decision.notes)


def _node(gpus=(), rdma=None, ray_version="2.60.0", python="3.12.1", disk=100.0):
    return {"hostname": "h", "node_ip": "10.0.0.1", "ray_version": ray_version, "python_version": python,
            "gpus": list(gpus), "driver_version": None, "cuda_version": None, "rdma": rdma or {},
            "disk_free_gb": disk, "disk_path": "/tmp"}  # fmt: skip


def test_doctor_checks_versions_gpus_devices_and_disk():
    from launcher.cli.doctor import check_nodes, layout_problem, profile_needs

    want = ("2.60.0", "3.12.1")
    h100 = ["NVIDIA H100 80GB HBM3"] * 8
    nodes = [
        (_node(h100, {"rdmap0": "efa"}), 8),
        (_node(h100[:4], {"rdmap0": "efa"}), 8),  # Ray declares more GPUs than the node has
        (_node(h100, {}, ray_version="2.59.0"), 8),  # another Ray, and no EFA device
        (_node(h100[:4], {"rdmap0": "efa"}, disk=3.0), 4),  # fewer GPUs than asked, disk nearly full
    ]
    reports = check_nodes(
        nodes, want, gpus_per_node=8, device="gpu", needs=profile_needs({"FI_PROVIDER": "efa"})
    )
    assert [r.status for r in reports] == ["ok", "FAIL", "FAIL", "WARN"]
    assert "nvidia-smi sees 4" in reports[1].problems[0]
    assert any("Ray 2.59.0" in p for p in reports[2].problems)
    assert any("no EFA device" in p for p in reports[2].problems)
    assert any("fewer than --gpus-per-node 8" in w for w in reports[3].warnings)
    assert any("3.0 GiB free" in w for w in reports[3].warnings)
    assert layout_problem(reports, nodes=3, gpus_per_node=8, device="gpu") is None
    assert "1 node(s) have 8 or more" not in (layout_problem(reports, 4, 8, "gpu") or "")
    assert "3 node(s) have 8 or more GPUs" in layout_problem(reports, 4, 8, "gpu")
    assert profile_needs({"NCCL_IB_DISABLE": "0"}) == "infiniband" and profile_needs({}) is None


def test_bus_bandwidth_and_slow_nodes():
    from launcher.cli.doctor import bus_bandwidth, slow_nodes

    # nccl-tests: busbw = size / time x 2(n-1)/n
    assert bus_bandwidth(1 << 30, 0.01, 8) == pytest.approx((1 << 30) / 0.01 * 14 / 8 / 1e9)
    assert bus_bandwidth(1 << 20, 0.01, 1) == 0.0
    assert slow_nodes({0: 100.0, 1: 98.0, 2: 30.0, 3: 101.0}) == [2]
    assert slow_nodes({0: 5.0}) == []


def test_credentials_inside_values_are_redacted_whatever_the_name():
    from launcher.core.rankenv import redact

    env = {
        "DATABASE_URL": "postgres://user:s3cret@db:5432/app",
        "BROKER": "redis://:pw@h:6379/0",
        "HEADER": "Authorization: Bearer abc.def-123",
        "PLAIN": "https://example.org/x?a=1",
        "HF_TOKEN": "hf_abc",
    }
    assert redact(env) == {
        "DATABASE_URL": "postgres://user:<redacted>@db:5432/app",
        "BROKER": "redis://:<redacted>@h:6379/0",
        "HEADER": "Authorization: Bearer <redacted>",
        "PLAIN": "https://example.org/x?a=1",
        "HF_TOKEN": "<redacted>",
    }


def test_a_nodes_batch_puts_the_console_first_and_gives_every_rank_its_turn():
    """A forwarder's batch (core/outbatch.py): every report and wait sample, all of the console ranks'
    output, then the other ranks' in turns up to the budget; what is left comes next, in order."""
    held = Held(console=frozenset({5}))
    for rank in (1, 2, 3, 5):
        held.add(Source(rank), b"x" * 100, 0)
        held.add(Source(rank), b"y" * 100, 100)
    held.reports.append((1, {"iteration": 3}))
    held.samples.append(WaitSample(2, 0.0, 10, 7))
    first = held.take(budget=250)
    assert [(r, s) for (r, _), s, _ in first.chunks] == [(5, 0), (5, 100), (1, 0), (1, 100), (2, 0)]
    assert first.reports == ((1, {"iteration": 3}),) and first.samples == (WaitSample(2, 0.0, 10, 7),)
    assert first.writes == 8 and held.bytes == 300
    second = held.take(budget=250)  # rank 2's turn goes on where it stopped, then rank 3
    assert [(r, s) for (r, _), s, _ in second.chunks] == [(2, 100), (3, 0), (3, 100)]
    assert not held and held.bytes == 0 and second.writes == 0 and not held.take(250)
    held.add(Source(5, STDERR), b"!\n", 0)  # a console rank's stderr goes first too
    held.add(Source(1), b"z" * 10_000, 200)  # one chunk beyond the budget still goes: nothing is stuck
    assert [c[0] for c in held.take(budget=100).chunks] == [Source(5, STDERR), Source(1)]


def test_a_batch_joins_a_ranks_adjacent_chunks_and_the_sink_counts_the_ranks_writes(tmp_path):
    r0, r0err, r1 = Source(0), Source(0, STDERR), Source(1)
    assert merged([(r0, 0, b"ab"), (r0, 2, b"c\n"), (r0err, 0, b"!\n"), (r1, 0, b"d\n"), (r0, 9, b"e")]) == [
        (r0, 0, b"abc\n"), (r0err, 0, b"!\n"), (r1, 0, b"d\n"), (r0, 9, b"e")
    ]  # fmt: skip
    sink = OutputSink(str(tmp_path), node_of_rank=[0, 0], console=frozenset({0, 1}))
    chunks = ((r0, 0, b"one\n"), (r0, 4, b"two\n"), (r1, 0, b"three\n"))
    sink.take(OutputBatch(chunks, ((1, {"iteration": 1}),), (WaitSample(0, 0.0, 5, 2),), writes=3))
    console, progress, writes = sink.drain()
    assert [ln for _, ln in console] == ["[r0 n0] one", "[r0 n0] two", "[r1 n0] three"] and writes == 4
    assert [p["rank"] for p in progress] == [1, 0] and progress[1]["sample"].at > 0
    assert sink.received_of([r0, r1, Source(2)]) == [8, 6, 0]


def test_batches_scale_with_the_nodes():
    """At most 64 MiB in flight for all nodes together and 1,000 sink calls a second."""
    assert batch_bytes(1) == 4 << 20 and batch_bytes(1024) == 64 << 10 and batch_bytes(100_000) == 64 << 10
    assert send_every(8) == 0.05 and send_every(1024) == pytest.approx(1.024)


def test_a_forwarders_flush_waits_for_what_it_held_not_for_what_keeps_coming():
    """A rank that returns flushes its node's forwarder (rank/capture.py): that must not wait for the
    node's other ranks, which may print until the end of the run. The forwarder's own logic, against a
    stand-in for the driver's sink that takes 20 ms a batch."""
    import asyncio

    from launcher.rank.forwarder import NodeForwarder

    class Take:
        def __init__(self, batches: list):
            self.batches = batches

        def remote(self, batch):
            async def taken():
                await asyncio.sleep(0.02)
                self.batches.append(batch)

            return taken()

    class Sink:
        def __init__(self):
            self.batches: list = []
            self.take = Take(self.batches)

    async def main() -> list:
        sink = Sink()
        forwarder = NodeForwarder(sink, frozenset(), nodes=1024)  # gathers for a second between batches
        printing = True

        async def chatty() -> None:
            offset = 0
            while printing:
                await forwarder.write(Source(1), b"more\n", offset)
                offset += 5
                await asyncio.sleep(0.005)

        other = asyncio.create_task(chatty())
        await asyncio.sleep(0.1)
        await forwarder.write(Source(0), b"last words\n", 0)
        await asyncio.wait_for(forwarder.flush(), timeout=5)  # returns: the other rank still prints
        printing = False
        await other
        await forwarder.close()
        return [c for b in sink.batches for c in b.chunks if c[0].rank == 0]

    assert asyncio.run(main()) == [(Source(0), 0, b"last words\n")]


def test_ray_s_crash_handler_lines_stay_off_the_console_and_in_the_rank_log(tmp_path):
    """#45 item 6: a crashing rank's console lines are the program's (faulthandler's stack, its own
    frames), not Ray's failure handler's signal line, raw addresses and logging.cc lines, nor the
    frames of Ray's worker loop and megaray's rank code; a Python traceback's frames stay."""
    sink = OutputSink(str(tmp_path), node_of_rank=[0], console=frozenset({0}))
    dump = [
        "last words",
        "Fatal Python error: Segmentation fault",
        '  File "/tmp/die.py", line 8 in <module>',
        '  File "/v/lib/python3.12/site-packages/launcher/rank/programs.py", line 41 in run_script',
        '  File "/v/lib/python3.12/site-packages/ray/_private/worker.py", line 946 in main_loop',
        '  File "<frozen runpy>", line 88 in _run_code',
        "*** SIGSEGV received at time=1764180000 on cpu 1 ***",
        "PC: @     0x7f3a2b4c5d6e  (unknown)  string_at",
        "    @     0x7f3a2b4c5d6f        208  absl::WriteFailureInfo()",
        "[2026-11-26 19:56:02,123 E 6334 6334] logging.cc:474: *** SIGSEGV received at time=1764180000 ***",
        "Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)",
    ]
    python = '  File "/v/lib/python3.12/site-packages/ray/util/x.py", line 3, in f'  # a traceback's
    sink.write(Source(0, STDERR), ("\n".join([*dump, python]) + "\n").encode(), 0)
    console, _, _ = sink.finish()
    assert console == [(STDERR, "[r0 n0] " + ln) for ln in [*dump[:3], python]]
    assert (tmp_path / "rank-0.log").read_text() == "".join(f"[r0 n0] {ln}\n" for ln in [*dump, python])


def test_a_run_directory_deleted_mid_run_is_said_and_the_run_goes_on(tmp_path, caplog):
    """#46 item 10: a run directory deleted while the job ran ended the launch in a FileNotFoundError
    traceback. Each file that cannot be written is said; the rank logs count what they lost."""
    import logging
    import shutil

    from launcher.driver.output.rankfiles import RankFiles
    from launcher.driver.output.rundir import RunDir

    run = RunDir(tmp_path / "job")
    files = RankFiles(run.path, 2)
    files.creator.join()
    shutil.rmtree(run.path)
    with caplog.at_level(logging.WARNING, logger="megaray"):
        run.write_summary(status="succeeded", exit_code=0)
    assert "summary.json could not be written in the run directory" in caplog.text
    files.close()  # the files made ahead are gone with the folder: opened anew, which fails
    assert files.write(0, "a\n") == "No such file or directory" and files.write(1, "bc\n") is None
    assert files.lost_summary() == "5 bytes of rank output were not written (rank-1.log 3, rank-0.log 2)"
    run.path.mkdir()  # writing resumes: the file says what it missed first
    assert files.write(0, "d\n") is None
    assert (run.path / "rank-0.log").read_text() == (
        "[megaray: 2 bytes of this rank's output could not be written here (No such file or directory)]\nd\n"
    )


def test_bytes_that_are_not_utf8_reach_the_rank_log_as_written(tmp_path):
    """#46 item 11: invalid UTF-8 was replaced in the rank's log too, the original bytes lost; the
    console and the report show U+FFFD for them."""
    sink = OutputSink(str(tmp_path), node_of_rank=[0], console=frozenset({0}))
    out = Source(0)
    sink.write(out, b"ok \xff\xfe end\n\xe2\x82", 0)  # then half a euro sign: the rest comes next
    sink.write(out, b"\xac and \xc3", 12)
    assert sink.tail(0) == ["ok \ufffd\ufffd end", "\u20ac and "]  # \xc3 may start a character
    console, _, _ = sink.finish()
    assert [ln for _, ln in console] == ["[r0 n0] ok \ufffd\ufffd end", "[r0 n0] \u20ac and \ufffd"]
    written = b"[r0 n0] ok \xff\xfe end\n[r0 n0] \xe2\x82\xac and \xc3\n"
    assert (tmp_path / "rank-0.log").read_bytes() == written


def test_a_bar_redrawn_with_carriage_returns_is_shown_as_it_goes_and_not_held_whole():
    """#46 item 11: a `\\r`-only progress bar reached neither console nor log until its newline, and
    every redraw piled up in the sink. Its state is shown as a line now and then; what is held is its
    latest state; a finished line shows what a terminal would."""
    from launcher.core.redraws import last_state, split_lines

    assert last_state("plain") == "plain" and last_state("a\r") == "a" and last_state("\r 1%\r 2%") == " 2%"
    assert split_lines("done\r\nnext") == (["done"], "next", None)
    assert split_lines("x\n\r 1%|#\r 2%|##") == (["x"], " 2%|##", " 2%|##")
    assert split_lines("\r") == ([], "", None)


def test_the_sink_shows_a_redrawn_bar_at_most_every_second_and_its_end_once(tmp_path):
    sink = OutputSink(str(tmp_path), node_of_rank=[0], console=frozenset({0}))
    out, sent = Source(0, STDERR), 0

    def write(data: bytes) -> list[str]:
        nonlocal sent
        sink.write(out, data, sent)
        sent += len(data)
        return [ln for _, ln in sink.drain()[0]]

    assert write(b"\r  0%|") == ["[r0 n0]   0%|"]  # the first state, at once
    assert write(b"\r 50%|#####") == [] and sink.partial[out] == " 50%|#####"  # held: the latest only
    sink.bar_at[out] -= 1.0  # a second later
    assert write(b"\r 90%|#########") == ["[r0 n0]  90%|#########"]
    assert write(b"\r100%|##########\n") == ["[r0 n0] 100%|##########"]  # the end, at its newline
    sink.finish()
    assert (tmp_path / "rank-0.log").read_text().splitlines() == [
        "[r0 n0]   0%|",
        "[r0 n0]  90%|#########",
        "[r0 n0] 100%|##########",
    ]


def test_the_drivers_drain_waits_for_news_and_is_answered_when_it_comes(tmp_path):
    """The sink's long-poll drain (driver/output/sink_host.py): answered when a console rank's line
    or progress arrives, not for a wait sample or a line the console does not show; a drain right
    after an answer waits out DRAIN_GAP_S (a busy console in batches); a `wake` answers the drain
    it names at once, also one that Ray started before that drain (async actors' calls may start out
    of order), and no other; with nothing, it ends after its wait."""
    import asyncio

    from launcher.driver.output.sink_host import SinkForwarder

    quiet = OutputBatch(((Source(1), 0, b"not shown\n"),), samples=(WaitSample(0, 0.0, 5, 2),), writes=1)
    hello = OutputBatch(((Source(0), 0, b"hello\n"),), writes=1)
    again = OutputBatch(((Source(0), 6, b"again\n"),), writes=1)

    async def main() -> None:
        sink = SinkForwarder(str(tmp_path), node_of_rank=[0, 0], console=frozenset({0}))
        assert await sink.drain(0.05) == ([], [], 0)  # nothing came: after its wait
        waiting = asyncio.create_task(sink.drain(60.0))
        await sink.take(quiet)
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await sink.take(hello)
        lines, progress, writes = await asyncio.wait_for(waiting, 5)
        assert [ln for _, ln in lines] == ["[r0 n0] hello"] and len(progress) == 1 and writes == 2
        await sink.take(again)  # news at once, but the last answer was just now
        gapped = asyncio.create_task(sink.drain(60.0))
        await asyncio.sleep(0)
        assert not gapped.done()
        assert [ln for _, ln in (await asyncio.wait_for(gapped, 5))[0]] == ["[r0 n0] again"]
        waiting = asyncio.create_task(sink.drain(60.0, token="a"))
        await asyncio.sleep(0.05)
        await sink.wake("a")
        assert await asyncio.wait_for(waiting, 5) == ([], [], 3)
        await sink.wake("b")  # meant for the drain below, which starts after it
        assert await asyncio.wait_for(sink.drain(60.0, token="b"), 5) == ([], [], 3)
        assert await sink.drain(0.05, token="a") == ([], [], 3)  # a wake serves its own drain once

    asyncio.run(main())
