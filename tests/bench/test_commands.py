"""``python -m bench <command>``: one entry, one argument vocabulary, one JSON document.

Every command runs once at a tiny size with ``--json`` and its document validates against the
schema (``bench.schema``); the collective ones run as a user runs them (``mpiexec -n 2 python -m
bench <command>``, launched from the 1-rank job), the one-process ones in this process. The
documents also say what the sweep reads from them consistently with their own details (the
busiest rank's bytes per channel kind, the ratios), and the schema rejects what it must.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile

import pytest

from bench.ep import TARGET_SPEEDUP
from deepep_ascend import native
from tests.support import REPO_ROOT
from tests.support.mpi_utils import child_env, run_child_command, world

ONE_RANK = pytest.mark.skipif(world().Get_size() != 1, reason="launches its own jobs; runs in the 1-rank job only")

# tiny sizes, few iterations, no timed warm-up (bench.timing.warm_up has its own tests): seconds each on 2 cores
COLLECTIVE = {
    "normal": ["--num-tokens", "64", "--hidden", "256", "--num-experts", "8", "--num-topk", "2", "--iters", "2",
               "--warmup", "1", "--warmup-s", "0", "--no-progress"],
    "ep": ["--num-tokens", "32", "--hidden", "256", "--num-experts", "8", "--num-topk", "2", "--iters", "2",
           "--warmup", "1", "--warmup-s", "0", "--no-progress"],
    "low-latency": ["--num-tokens", "16", "--hidden", "256", "--num-experts", "8", "--num-topk", "2", "--iters", "2",
                    "--warmup", "1", "--warmup-s", "0"],
    "mega-moe": ["--preset", "tiny", "--num-tokens", "32", "--iters", "1", "--warmup", "1", "--warmup-s", "0",
                 "--threads", "1"],
    "urma-put": ["--bytes", "65536", "--iters", "2"],
    "engram": ["--num-entries-per-layer", "300,301", "--num-tokens", "16", "--num-entries-per-token", "4",
               "--use-fp8", "--iters", "2", "--warmup", "1", "--warmup-s", "0"],
    "pp": ["--num-tokens", "16", "--hidden", "256", "--num-max-inflight-tensors", "2", "--iters", "2", "--warmup", "1",
           "--warmup-s", "0"],
    "bucket": ["--num-bytes", "65536", "--iters", "2", "--warmup", "1", "--warmup-s", "0"],
    "lb": ["--hidden", "64", "--inter", "32", "--num-local-experts", "2", "--num-redundant-experts", "3", "--iters",
           "2", "--warmup", "1", "--warmup-s", "0"],
    "overhead": ["--num-tokens-list", "1,3", "--hidden", "256", "--num-experts", "8", "--num-topk", "2", "--iters", "2",
                 "--warmup", "1", "--warmup-s", "0"],
    "soak": ["--num-tokens", "16", "--hidden", "512", "--num-experts", "8", "--num-topk", "2", "--iters", "24",
             "--report-every", "8", "--no-progress"],
}
ONE_PROCESS = {
    "grouped-gemm": ["--groups", "3", "--rows", "40", "--k", "64", "--n", "32", "--iters", "3", "--warmup-s", "0"],
    "combine-sum": ["--num-tokens", "96", "--hidden", "64", "--missing", "2,30", "--iters", "1", "--sources", "3",
                    "--warmup-s", "0", "--ll-tokens", "3", "--evict-mb", "1"],
    "moe-act": ["--rows", "64", "--hidden", "64", "--inter", "64", "--iters", "3", "--warmup-s", "0"],
    "fp8-decode": ["--rows", "4", "--hidden", "96", "--iters", "1", "--warmup-s", "0"],
    "logfmt": ["--rows-list", "1,3", "--hidden", "256", "--iters", "1", "--warmup", "0", "--warmup-s", "0"],
    "ll-receive": ["--num-tokens", "6", "--hidden", "256", "--num-topk", "3", "--num-experts", "9", "--sources", "3",
                   "--evict-mb", "1", "--iters", "2"],
    "sort": ["--sizes", "5,300,70000", "--num-experts", "40000", "--iters", "1", "--warmup", "0", "--warmup-s",
             "0"],
    "alloc": ["--mbytes", "1", "--iters", "1", "--warmup-s", "0"],
}


PHASES = ("normal", "low-latency", "ep")
OVERHEAD_SPLIT = ["--num-tokens-list", "1", "--hidden", "256", "--num-experts", "8", "--num-topk", "2", "--iters", "2",
                  "--warmup", "1", "--warmup-s", "0", "--systems", "low_latency,normal,ep", "--native-split",
                  "--bindings"]
WARM_UPS = ("0", "0.4")
TINY_EXPANDED_EP = ["--num-tokens", "24", "--hidden", "256", "--num-experts", "8", "--num-topk", "3", "--iters", "1",
                    "--warmup", "1", "--warmup-s", "0", "--no-progress", "--expand", "--expert-alignment", "4"]


def _job_runs() -> dict:
    """The runs of the collective commands the tests below check, ``{label: (command, argv)}``; all go through one
    2-rank job (the ``commands_job`` fixture): one interpreter and MPI start instead of one per run."""
    runs = {command: (command, argv) for command, argv in COLLECTIVE.items()}
    for command in PHASES:
        argv = COLLECTIVE[command] + ["--phases", "--native-split"]
        if command == "low-latency":  # (the plain run has the default experts and stores)
            argv += ["--no-baselines", "--zero-copy", "--stream-rows", "always", "--compare-sends"]
        runs[f"{command} --phases"] = (command, argv)
    runs["overhead --native-split"] = ("overhead", OVERHEAD_SPLIT)
    runs["ep --expand across two nodes"] = ("ep", TINY_EXPANDED_EP + ["--zero-padding", "--ranks-per-node", "1",
                                                                     "--systems", "ep,v1", "--loop", "2",
                                                                     "--compare-sends"])
    runs["ep --expand, one rounding"] = ("ep", TINY_EXPANDED_EP + ["--no-multiple-reduction", "--systems", "ep",
                                                                   "--compare-sends"])
    for command in ("low-latency", "engram"):
        for seconds in WARM_UPS:
            argv = [a for a in COLLECTIVE[command] if a not in ("--warmup-s", "0")] + ["--warmup-s", seconds]
            # (the low-latency one at 0 s also compares the combine's send modes: timed after the traffic counted)
            extra = ["--no-baselines"] + (["--compare-sends"] if seconds == "0" else []) if command == "low-latency" \
                else []
            runs[f"{command} --warmup-s {seconds}"] = (command, argv + extra)
    return runs


@dataclasses.dataclass
class JobRun:
    """One run of the shared job: its document and the lines the job printed while it ran."""

    path: str
    out: str

    def doc(self) -> dict:
        with open(self.path) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def commands_job():
    """Runs :func:`_job_runs` in one ``mpiexec -n 2 python -m tests.bench.commands_job`` (as a user runs each
    command, but in one pair of processes) and returns ``{label: JobRun}``; fails every test using it if the job
    fails."""
    from bench.internals import mpiexec_path

    d = tempfile.mkdtemp(prefix="bench_commands_job_")
    runs = _job_runs()
    paths = {label: os.path.join(d, f"run{i}.json") for i, label in enumerate(runs)}
    spec = json.dumps([[label, command, [*argv, "--json", paths[label]]] for label, (command, argv) in runs.items()])
    rc, out = run_child_command([mpiexec_path() or "mpiexec", "-n", "2", sys.executable, "-m",
                                 "tests.bench.commands_job", spec], REPO_ROOT,
                                child_env(REPO_ROOT, OMP_NUM_THREADS="1"), 900)
    try:
        assert rc == 0, f"the commands' job exited {rc}:\n{out[-3000:]}"
        pieces = re.split(r"^=== run: (.+)$", out, flags=re.MULTILINE)  # [before, label, text, label, text, ...]
        printed = dict(zip(pieces[1::2], pieces[2::2]))
        assert list(printed) == list(runs), (list(printed), out[-3000:])
        yield {label: JobRun(paths[label], printed[label]) for label in runs}
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def out_dir():
    """A private temporary directory (not pytest's tmp_path: concurrent ranks race on its cleanup)."""
    d = tempfile.mkdtemp(prefix="bench_commands_test_")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_every_command_is_tested():
    from bench.commands import COMMANDS

    assert set(COMMANDS) == set(COLLECTIVE) | set(ONE_PROCESS)
    assert {n for n, c in COMMANDS.items() if c.collective} == set(COLLECTIVE)


def test_help_lists_the_commands_one_line_each():
    rc, out = run_child_command([sys.executable, "-m", "bench", "--help"], REPO_ROOT, child_env(REPO_ROOT), 120)
    assert rc == 0, out
    from bench.commands import COMMANDS

    listing = out[out.index("commands:"):].splitlines()[1:]
    for name, cmd in COMMANDS.items():
        line = next(ln for ln in listing if ln.split()[:1] == [name])
        assert cmd.summary.split()[0] in line, (name, line)
    rc, out = run_child_command([sys.executable, "-m", "bench", "fp8-decode", "--help"], REPO_ROOT,
                                child_env(REPO_ROOT), 120)
    assert rc == 0 and "python -m bench fp8-decode" in out and "--json FILE" in out, out
    rc, out = run_child_command([sys.executable, "-m", "bench", "no-such-command"], REPO_ROOT,
                                child_env(REPO_ROOT), 120)
    assert rc == 2 and "invalid choice: 'no-such-command'" in out, out


def test_one_vocabulary():
    """A shared option is spelled and explained the same in every command that takes it; no command
    declares an option of its own under a shared name or an old spelling of one."""
    from bench import cli, commands

    shared = {flag: text for flag, _, text in cli.SHARED.values()}
    for name in commands.COMMANDS:
        p = commands.parser(name)
        flags = {s for a in p._actions for s in a.option_strings}
        assert not flags & {"--tokens", "--topk", "--experts"}, name
        assert "--json" in flags and "--iters" in flags, name
        for a in p._actions:
            for s in a.option_strings:
                if s in shared:
                    assert a.help.startswith(shared[s]), (name, s, a.help)
    with pytest.raises(KeyError):
        cli.add_shared(commands.parser("alloc"), rows=3)


def test_each_command_takes_exactly_the_shared_options_its_help_lists():
    """Parse only: every shared flag a command's ``--help`` lists parses, every other one is refused
    (argparse's usage error, exit 2, also for a prefix of a longer own option); ``--json`` and
    ``--no-progress`` are listed by every command, and the top-level ``--help`` lists the vocabulary."""
    import re

    from bench import cli, commands

    value = {"--json": ["out.json"], "--link-profile": ["none"], "--link-emulation": ["none"],
             "--link-scale": ["0.5"], "--no-progress": [], "--phases": [], "--native-split": []}
    vocabulary = cli.shared_flags()
    assert len(vocabulary) == len(cli.SHARED) + 3
    for name in commands.COMMANDS:
        p = commands.parser(name)
        listed = set(re.findall(r"^ {2}(--[a-z][a-z0-9-]*)", p.format_help(), flags=re.M))
        assert {"--json", "--no-progress"} <= listed, (name, sorted(listed))
        for flag in vocabulary:
            argv = [flag] + value.get(flag, ["64"])
            if flag in listed:
                ns = p.parse_args(argv)
                dest = flag[2:].replace("-", "_")
                assert getattr(ns, dest) == (True if not value.get(flag, 1) else type(getattr(ns, dest))(argv[1])), \
                    (name, flag)
            else:
                with pytest.raises(SystemExit) as e:
                    p.parse_args(argv)
                assert e.value.code == 2, (name, flag)
    top = commands._shared_listing()
    assert all(re.search(rf"{f}\b", top) for f in vocabulary), top


def _check_doc(doc: dict, command: str, num_ranks: int) -> None:
    from bench import schema

    schema.validate(doc)
    assert doc["command"] == command and doc["params"]["num_ranks"] == num_ranks
    assert doc["checks"]["ok"] is True, doc["checks"]
    by = schema.results_by_name(doc)
    for r in doc["results"]:
        assert r["seconds"] > 0, r
        if r["bytes"] is not None and r["gbps"] is not None:
            assert math.isclose(r["gbps"], r["bytes"] / 1e9 / r["seconds"], rel_tol=1e-9), r
        for other, ratio in r.get("ratio_to", {}).items():
            assert math.isclose(ratio, r["seconds"] / by[other]["seconds"], rel_tol=1e-9), (r["name"], other)


def _check_details(command: str, doc: dict) -> None:
    """What the sweep reads agrees with the command's own per-rank details."""
    by = {r["name"]: r for r in doc["results"]}
    det = doc["details"]
    if command == "normal":
        for system in ("deepep_ascend", "mpi_alltoallv", "gloo_all_to_all"):
            phases = det["systems"][system]["phases"]
            for p in ("dispatch", "combine"):
                assert by[f"{system}/{p}"]["bytes"] == max(phases[p]["bottleneck_bytes_per_rank"])
            sent = [phases[p]["sent_by_kind"] for p in ("dispatch", "combine")]
            for k, v in by[f"{system}/round_trip"]["by_kind"].items():  # busiest rank's dispatch + combine bytes
                assert v == max(a + b for a, b in zip(sent[0][k]["bytes_per_rank"], sent[1][k]["bytes_per_rank"]))
        assert set(doc["baselines"]) >= {"mpi_alltoallv/round_trip", "gloo_all_to_all/round_trip",
                                         "memcpy_roofline/round_trip"}
        peers = min(by[f"{p}/round_trip"]["seconds"] for p in ("mpi_alltoallv", "gloo_all_to_all"))
        assert math.isclose(doc["summary"]["speedup_over_faster_peer"],
                            peers / by["deepep_ascend/round_trip"]["seconds"])
        s = doc["summary"]  # the printed verdicts, as data: the target of the job's rank count and whether it was met
        want = {2: (5.0, 2.5), 4: (3.0, None), 8: (3.0, None)}.get(doc["params"]["num_ranks"], (None, None))
        assert (s.get("speedup_target"), s.get("roofline_target")) == want, s
        if want[0] is not None:
            assert s["speedup_target_met"] == (s["speedup_over_faster_peer"] >= want[0])
        if want[1] is not None:
            assert s["roofline_target_met"] == (s["round_trip_over_roofline"]["deepep_ascend"] <= want[1])
    elif command == "ep":
        _check_ep_details(doc, by)
    elif command == "soak":  # every kind of call ran, every report is there, the verdict follows from them
        assert set(det["round_trips_per_op"]) == {"normal", "cached", "low_latency", "ep"}
        assert all(v > 0 for v in det["round_trips_per_op"].values()) and sum(det["round_trips_per_op"].values()) == 24
        reports = det["reports"]
        assert [r["calls"] for r in reports] == [8, 16, 24] and all(len(r["rss_anon"]) == 2 for r in reports)
        growth = max(b - a for key in ("rss_anon", "rss_shmem") for a, b in zip(reports[0][key], reports[-1][key]))
        assert det["growth_bytes"] == growth and doc["checks"]["memory_flat"] == (growth <= 64e6)
    elif command == "lb":  # the bytes follow from the plan; the summary is the records' ratio
        cols = det["expert_elements"]
        assert cols == 3 * 64 * 32 and by["lb/prefetch"]["bytes"] == det["prefetch_bytes"] == 3 * cols * 2
        assert by["lb/reduce"]["bytes"] == det["reduce_bytes"] == 3 * cols * 4  # 2 ranks: all 3 slots of the peer
        for phase in ("prefetch", "reduce"):
            peers = min(by[f"{p}/{phase}"]["seconds"] for p in ("mpi_isend", "gloo_isend"))
            assert math.isclose(doc["summary"][f"speedup_over_faster_peer_{phase}"],
                                peers / by[f"lb/{phase}"]["seconds"])
    elif command == "overhead":  # one round trip per system and token count; the summary is the records' ratio
        assert det["tokens"] == [1, 3]
        for t in (1, 3):
            assert {r["system"] for r in doc["results"] if r["tokens_per_rank"] == t} == {
                "low_latency", "normal", "ep", "ep_decode", "ep_cached", "mpi_alltoall", "mpi_alltoallv", "memcpy_ll",
                "memcpy_rows", "ll_floor"}
            floor = by[f"mpi_alltoall/round_trip_t{t}"]["seconds"]
            for s in ("low_latency", "normal", "ep", "ep_decode", "ep_cached"):
                assert math.isclose(doc["summary"][f"{s}_over_mpi_alltoall_t{t}"],
                                    by[f"{s}/round_trip_t{t}"]["seconds"] / floor)
            ll_bytes, row_bytes = _overhead_layout_bytes(t, doc["params"]["num_ranks"])
            assert by[f"memcpy_ll/round_trip_t{t}"]["bytes"] == ll_bytes
            assert by[f"memcpy_rows/round_trip_t{t}"]["bytes"] == row_bytes
            for roof in ("memcpy_ll", "memcpy_rows", "ll_floor"):  # ll_floor: present, so checked bit for bit
                assert math.isclose(doc["summary"][f"{roof}_over_mpi_alltoall_t{t}"],
                                    by[f"{roof}/round_trip_t{t}"]["seconds"] / floor)
    elif command == "low-latency":
        cfg = det["config"]  # the commands' small shape: every rank's receive under the default threshold
        ranks = doc["params"]["num_ranks"]
        assert cfg["recv_rows_bytes_max"] > 0
        assert cfg["streamed_ranks"] == (ranks if cfg["stream_rows"] == "always" else 0), cfg
        assert cfg["send_rows_bytes_max"] > 0 or cfg["zero_copy"]  # (zero-copy: the receivers read the rows)
        assert cfg["streamed_send_ranks"] == 0, cfg  # the small shape: under the send side's default threshold
        b = det["bytes"]
        for p in ("dispatch", "combine"):
            assert by[f"deepep_ascend/{p}"]["bytes"] == max(b[f"{p}_per_rank"])
        for k, v in by["deepep_ascend/round_trip"]["by_kind"].items():  # busiest rank, one of `calls` round trips
            assert v == max(r[k] for r in b["moved_by_kind_per_rank"]) / b["calls"]
    elif command == "pp":  # DeepEP's byte formulas on the tensor bytes; the summary is the records' ratio
        nbytes = det["tensor_bytes"]
        for c in det["concurrent"]:
            for h in (0, 1):
                assert by[f"pp/send_c{c}_hide{h}"]["bytes"] == 2 * nbytes
                assert by[f"pp/recv_c{c}_hide{h}"]["bytes"] == (2 if h else 1) * nbytes
            ring = by[f"pp/ring_c{c}"]["seconds"]
            peers = min(by[f"{p}/ring_c{c}"]["seconds"] for p in ("mpi_isend", "gloo_isend"))
            assert math.isclose(doc["summary"][f"speedup_over_faster_peer_c{c}"], peers / ring)
    elif command == "bucket":  # DeepEP's formulas: the tensor's bytes; the summary is the records' ratio
        for op in ("all_gather", "reduce_scatter", "reduce_scatter_bf16", "all_reduce"):
            assert by[f"bucket/{op}"]["bytes"] == det["tensor_bytes"]
            base = op.removesuffix("_bf16")
            peers = min(by[f"{p}/{base}"]["seconds"] for p in ("mpi", "gloo") if f"{p}/{base}" in by)
            assert math.isclose(doc["summary"][f"speedup_over_faster_peer_{op}"], peers / by[f"bucket/{op}"]["seconds"])
    elif command == "mega-moe":
        fused = by["fused"]
        assert (fused["seconds"] == det["times_s"]["fused"]
                and fused["bytes"] == det["bandwidth_GBps"]["bytes_with_self"])
        for k, v in fused["by_kind"].items():
            assert v == max(r[k] for r in det["traffic_by_kind"])
        assert by["unfused/sum_stages"]["seconds"] == det["times_s"]["sum_stages"]


def _overhead_layout_bytes(tokens: int, num_ranks: int, hidden: int = 256, num_experts: int = 8,
                           num_topk: int = 2) -> tuple[int, int]:
    """The busiest rank's bytes, both ways, of ``overhead``'s two rooflines at COLLECTIVE's shape, counted here
    from each rank's routing: DeepEP's LL formula in BF16 (``2H + 16`` per valid selection out, ``2H`` back) and
    ``2H`` per distinct (token, destination rank) each way."""
    from bench.workload import make_workload

    per_rank = num_experts // num_ranks
    ll, rows = [], []
    for r in range(num_ranks):
        idx = make_workload(tokens, hidden, num_topk, num_experts, r, num_ranks).topk_idx.tolist()
        sel = sum(e >= 0 for row in idx for e in row)
        pairs = sum(len({e // per_rank for e in row if e >= 0}) for row in idx)
        ll.append(sel * (2 * hidden + 16) + sel * 2 * hidden)
        rows.append(2 * pairs * 2 * hidden)
    return max(ll), max(rows)


def _check_ep_details(doc: dict, by: dict) -> None:
    """``ep``: DeepEP V2's accounting (count_bytes per token x tokens) is the V2 logical formula, the records
    carry the busiest rank's bytes, the others' round trips include their layout, the summary's ratios are
    the records'."""
    from bench.formulas import logical_bytes

    det, p = doc["details"], doc["params"]
    ep = det["epbuffer"]
    per = ep["per_rank"]
    fp8 = not p["bf16"]
    for phase, key in (("dispatch", "scaleup_bytes"), ("combine", "combine_scaleup_bytes")):
        assert per[key] == [logical_bytes(n, p["hidden"], p["num_topk"], fp8, phase) for n in per["num_recv_tokens"]]
        assert by[f"epbuffer/{phase}"]["bytes"] == max(per[key])
        assert ep["phases"][phase]["scaleup_bytes_per_rank"] == per[key]
    nodes = det["nodes"]
    assert (max(per["scaleout_bytes"]) == 0) == (nodes == 1)
    assert per["scaleout_bytes"] == [t * s for t, s in zip(per["dispatch_token_bytes"], per["scaleout_tokens"])]
    for system in ("buffer_v1", "mpi_alltoallv", "gloo_all_to_all"):
        if f"{system}/round_trip" not in by:
            continue
        parts = [by[f"{system}/{ph}"]["times_s"] for ph in ("layout", "dispatch", "combine")]
        assert all(math.isclose(t, sum(x), rel_tol=1e-12) for t, x in zip(by[f"{system}/round_trip"]["times_s"],
                                                                           zip(*parts)))
        assert f"{system}/round_trip" in doc["baselines"]
    assert not [b for b in doc["baselines"] if b.startswith("epbuffer/")]
    s, ep_s = doc["summary"], by["epbuffer/round_trip"]["seconds"]
    if "buffer_v1/round_trip" in by:
        assert math.isclose(s["epbuffer_over_buffer_v1"], ep_s / by["buffer_v1/round_trip"]["seconds"])
    peers = [by[f"{n}/round_trip"]["seconds"] for n in ("mpi_alltoallv", "gloo_all_to_all") if f"{n}/round_trip" in by]
    if peers:
        assert math.isclose(s["speedup_over_faster_peer"], min(peers) / ep_s)
    if "memcpy_roofline_after_experts/round_trip" in by:  # the summary's ratios are the records'
        cold = by["memcpy_roofline_after_experts/round_trip"]["seconds"]
        assert math.isclose(s["epbuffer_over_roofline_after_experts"], ep_s / cold)
        goal = TARGET_SPEEDUP.get(len(det["roofline_bytes_per_rank"]))
        if peers and goal:
            assert math.isclose(s["target_time_over_roofline_after_experts"], min(peers) / goal / cold)
    checks = doc["checks"]["results"]
    assert checks["epbuffer_vs_reference"]["combined_x_equal"] is True
    if not p["expand"] and "buffer_v1/round_trip" in by:
        assert checks["epbuffer_vs_buffer_v1"]["combined_x_bitwise"] is True


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(600)
@ONE_RANK
def test_ep_expanded_across_two_nodes(commands_job):
    """``ep --expand --zero-padding`` across two simulated nodes (one rank each): the expanded layout, scale-out
    bytes and the two-rounding reference, checked and written like the default run; ``--loop`` times both
    systems back to back too."""
    run = commands_job["ep --expand across two nodes"]
    doc, out = run.doc(), run.out
    _check_doc(doc, "ep", 2)
    _check_ep_details(doc, {r["name"]: r for r in doc["results"]})
    assert doc["details"]["nodes"] == 2 and max(doc["details"]["epbuffer"]["per_rank"]["scaleout_tokens"]) > 0
    assert "layout expanded, expert_alignment 4, zero padding" in out and "each node's partial rounded to BF16" in out
    assert doc["details"]["workload"]["zero_padding"] is True
    # --loop: both systems back to back, five segments each, and their ratio
    loop = doc["details"]["loop"]
    assert set(loop) == {"epbuffer", "buffer_v1"} and all(len(t["times_s"]) == 5 for t in loop.values())
    assert all(0 < v < 10 for t in loop.values() for v in t["times_s"])
    ratio = loop["epbuffer"]["median_s"] / loop["buffer_v1"]["median_s"]
    assert abs(doc["summary"]["loop_epbuffer_over_buffer_v1"] - ratio) < 1e-9 and "[loop]" in out


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(600)
@ONE_RANK
def test_ep_one_rounding(commands_job):
    """``ep --expand --no-multiple-reduction`` on one node: ``EPBuffer(allow_multiple_reduction=False)`` runs (one
    combine pass per top-k slot) and passes the benchmark's check against the one-rounding reference. (With the
    identity experts that reference and the default's mostly give the same bits; the arithmetic itself is
    tested in tests/ep/test_ep_buffer.py ``test_one_rounding_modes``.)"""
    run = commands_job["ep --expand, one rounding"]
    doc, out = run.doc(), run.out
    assert doc["checks"]["results"]["epbuffer_vs_reference"]["combined_x_equal"] is True
    assert doc["details"]["workload"]["multiple_reduction"] is False
    assert "allow_multiple_reduction=False" in out and "every slot's row summed, one rounding" in out


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(300)
@ONE_RANK
def test_lb_across_nodes_says_why_and_exits():
    """``lb`` on two simulated nodes: one line naming the reason (one node needed), exit 2, no traceback."""
    from bench.internals import mpiexec_path

    rc, out = run_child_command([mpiexec_path() or "mpiexec", "-n", "2", sys.executable, "-m", "bench", "lb",
                                 *COLLECTIVE["lb"], "--no-progress"], REPO_ROOT,
                                child_env(REPO_ROOT, OMP_NUM_THREADS="1", DEEPEP_ASCEND_RANKS_PER_NODE="1"), 200)
    assert rc == 2 and "needs one node" in out and "Traceback" not in out and "Abort" not in out, out[-3000:]


@ONE_RANK
@pytest.mark.parametrize("argv, needle", [
    (["--hidden", "100"], "multiple of 128"),
    (["--num-topk", "9", "--num-experts", "8"], "exceeds"),
    (["--systems", "ep,nope"], "unknown system"),
    (["--expert-alignment", "0"], "must be >= 1"),
])
def test_ep_refuses_bad_options(argv, needle, capsys):
    """Bad shapes are usage errors (exit 2, the reason on stderr) before any rank starts work."""
    from bench import commands

    with pytest.raises(SystemExit) as e:
        commands.parse("ep", argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err, argv


TRACE = os.path.join(REPO_ROOT, "bench", "traces", "stdlib_moe_4r.npz")  # 26 rows of 4096 tokens, top-8


@ONE_RANK
@pytest.mark.parametrize("command, argv, needle", [
    ("normal", ["--num-topk", "300", "--num-experts", "256"], "at most --num-experts"),
    ("normal", ["--hidden", "100", "--fp8"], "--fp8 needs --hidden a multiple of 128"),
    ("normal", ["--nvl-bytes", "100"], "multiple of 128"),
    ("low-latency", ["--hidden", "200"], "FP8 dispatch (the default"),
    ("overhead", ["--json", "/nonexistent/dir/out.json"], "does not exist or is not writable"),
    ("logfmt", ["--json", REPO_ROOT], "needs a file name (that is a directory)"),
    ("normal", ["--json", ""], "--json '': needs a file name"),
    ("logfmt", ["--rows-list", ""], "--rows-list needs at least one row count"),
    ("ll-receive", ["--num-experts", "10", "--sources", "4"], "must be a multiple of --sources"),
    ("ll-receive", ["--hidden", "200"], "multiple of 128"),
    ("ep", ["--compare-sends", "--systems", "v1,mpi"], "--systems must include ep"),
    ("normal", ["--save-routing", "/nonexistent/dir/r.npz"], "does not exist or is not writable"),
    ("normal", ["--routing", "/nonexistent/r.npz"], "no such readable file"),
    ("normal", ["--routing-step", "5"], "--routing-step needs --routing"),
    ("normal", ["--routing", TRACE, "--routing-step", "999"], "outside [0, 26)"),
    ("normal", ["--routing", TRACE, "--num-tokens", "5"], "disagrees with the trace"),
    ("normal", ["--baselines-only", "--systems", "deepep_ascend"], "leaves no system"),
    ("low-latency", ["--num-tokens", "70000"], "must be below 65536"),
    ("overhead", ["--systems", "ll_floor,mpi_alltoall"], "list low_latency too"),
])
def test_option_combinations_are_usage_errors(command, argv, needle, capsys):
    """Values the library would refuse only mid-run (and a --json file that could not be written at the end)
    are usage errors before anything runs: exit 2, the reason on stderr."""
    from bench import commands

    with pytest.raises(SystemExit) as e:
        commands.parse(command, argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err, argv


@ONE_RANK
def test_a_routing_trace_is_read_once_and_replayed():
    """``--routing``: the options' check reads this rank's rows of the trace; the workload replays those rows and
    takes the trace's shape."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from bench import commands
    from bench.normal import build_workload

    args = commands.parse("normal", ["--routing", TRACE, "--routing-step", "3", "--hidden", "64"])
    rows = np.load(TRACE)["topk_idx"][3]
    assert np.array_equal(args.trace[0].numpy(), rows)  # one rank: every row
    wl, label = build_workload(args, MPI.COMM_WORLD)
    assert torch.equal(wl.topk_idx, args.trace[0]) and "step 3/26" in label
    assert (args.num_tokens, args.num_topk, args.num_experts) == (rows.shape[0], rows.shape[1], 16)


@ONE_RANK
def test_a_routing_file_that_is_no_trace_is_a_usage_error(out_dir, capsys):
    from bench import commands

    path = os.path.join(out_dir, "garbage.npz")
    with open(path, "w") as f:
        f.write("not an archive\n")
    with pytest.raises(SystemExit) as e:
        commands.parse("normal", ["--routing", path])
    assert e.value.code == 2 and "not a readable .npz archive of arrays" in capsys.readouterr().err


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(300)
@ONE_RANK
def test_rank_count_mismatches_are_one_usage_error():
    """Under ``mpiexec -n 2``: --num-experts not a multiple of the ranks, --ranks-per-node not dividing them (and
    ``urma-put``, a 2-rank command, under ``mpiexec -n 3``): exit 2 with the reason printed once (by rank 0), no
    traceback, no MPI_Abort."""
    from bench.internals import mpiexec_path

    for argv, needle in ((["--num-experts", "7"], "multiple of the number of ranks (2)"),
                         (["--ranks-per-node", "3"], "must divide the number of ranks (2)")):
        rc, out = run_child_command([mpiexec_path() or "mpiexec", "-n", "2", sys.executable, "-m", "bench", "normal",
                                     "--num-tokens", "8", "--no-progress", *argv], REPO_ROOT,
                                    child_env(REPO_ROOT, OMP_NUM_THREADS="1"), 200)
        assert rc == 2 and out.count(needle) == 1 and "Traceback" not in out and "Abort" not in out, out[-3000:]
    # a command for exactly 2 ranks, run on 3
    rc, out = run_child_command([mpiexec_path() or "mpiexec", "-n", "3", sys.executable, "-m", "bench", "urma-put",
                                 "--iters", "1", "--no-progress"], REPO_ROOT, child_env(REPO_ROOT, OMP_NUM_THREADS="1"),
                                200)
    needle = "runs on exactly 2 ranks (mpiexec -n 2), got 3"
    assert rc == 2 and out.count(needle) == 1 and "Traceback" not in out, out[-3000:]
    # the command itself missing or unknown: the same, before any command parses
    for argv, needle in (([], "a command is required"), (["bogus"], "invalid choice: 'bogus'")):
        rc, out = run_child_command([mpiexec_path() or "mpiexec", "-n", "2", sys.executable, "-m", "bench", *argv],
                                    REPO_ROOT, child_env(REPO_ROOT, OMP_NUM_THREADS="1"), 200)
        assert rc == 2 and out.count(needle) == 1 and "Traceback" not in out, out[-3000:]


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(300)
@ONE_RANK
def test_bad_environment_variable_is_its_message_without_traceback():
    """A collective command under ``mpiexec -n 2`` with ``DEEPEP_ASCEND_TIMEOUT_S=abc``: the job fails (nonzero exit)
    with the setting's message on a line of its own, no traceback."""
    from bench.internals import mpiexec_path

    rc, out = run_child_command([mpiexec_path() or "mpiexec", "-n", "2", sys.executable, "-m", "bench", "normal",
                                 "--num-tokens", "8", "--hidden", "256", "--no-progress"], REPO_ROOT,
                                child_env(REPO_ROOT, OMP_NUM_THREADS="1", DEEPEP_ASCEND_TIMEOUT_S="abc"), 200)
    assert rc != 0 and "SettingError: $DEEPEP_ASCEND_TIMEOUT_S must be a finite number > 0, got 'abc'\n" in out \
        and "Traceback" not in out, out[-3000:]


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(600)
@ONE_RANK
def test_collective_commands_write_valid_documents(commands_job, out_dir):
    from bench.internals import mpiexec_path

    for command in COLLECTIVE:
        run = commands_job[command]
        doc = run.doc()
        _check_doc(doc, command, 2)
        _check_details(command, doc)
        assert doc["host"]["mpi"] and doc["argv"][-2:] == ["--json", run.path], doc["argv"]
    mpiexec = mpiexec_path() or "mpiexec"
    env = child_env(REPO_ROOT, OMP_NUM_THREADS="1")
    # the thin alias runs the same command
    path = os.path.join(out_dir, "alias.json")
    rc, out = run_child_command([mpiexec, "-n", "2", sys.executable, "-m", "bench.urma_put", "--bytes", "4096",
                                 "--iters", "1", "--json", path], REPO_ROOT, env, 300)
    assert rc == 0, out[-3000:]
    with open(path) as f:
        _check_doc(json.load(f), "urma-put", 2)


@ONE_RANK
@pytest.mark.skipif(not native.ll_available(), reason="native kernels not built")
@pytest.mark.parametrize("broken", ["nothing written", "one byte"])
def test_ll_receive_check_fails_when_a_mode_writes_other_bytes(broken, monkeypatch, capsys):
    """bench ll-receive's check compares each mode's outputs with never's from a receive into a fresh pattern: a
    streaming mode that wrote nothing, or one wrong byte, fails it (exit 1)."""
    from bench import commands

    real = native.ll_dispatch_recv

    def receive(*args):
        if native.ll_stream_rows() == "never":
            return real(*args)
        if broken == "nothing written":
            return 0, [0, 0, 0]
        out = real(*args)
        args[9].view(-1)[0] ^= 1  # recv_x
        return out

    monkeypatch.setattr(native, "ll_dispatch_recv", receive)
    argv = ONE_PROCESS["ll-receive"]
    assert commands.call("ll-receive", argv) == 1
    assert "equal never's: False" in capsys.readouterr().out
    monkeypatch.setattr(native, "ll_dispatch_recv", real)
    assert commands.call("ll-receive", argv) == 0


@ONE_RANK
@pytest.mark.parametrize("command", sorted(ONE_PROCESS))
def test_one_process_commands_write_valid_documents(command, out_dir, capsys):
    from bench import commands

    path = os.path.join(out_dir, f"{command}.json")
    assert commands.call(command, ONE_PROCESS[command] + ["--json", path]) == 0
    capsys.readouterr()
    with open(path) as f:
        doc = json.load(f)
    _check_doc(doc, command, 1)
    assert doc["host"]["mpi"] is None and doc["fingerprint"] is None
    if command != "moe-act" or doc["checks"]["native"]:
        assert doc["results"] and set(doc["baselines"]) < {r["name"] for r in doc["results"]}
    if command == "combine-sum":  # the native loops: 2 and 3 sources, without and with a bias; the weighted sum
        loops = {r["phase"]: r for r in doc["results"] if r["system"] == "avx2"}
        assert not loops or sorted(loops) == ["2 sources", "2 sources + bias pair", "3 sources",
                                              "3 sources + bias pair",
                                              "low-latency weighted sum, 3 tokens x top-8, cold",
                                              "low-latency weighted sum, 3 tokens x top-8, warm"], sorted(loops)
        assert all(set(r["ratio_to"]) == {f"portable/{case}"} for case, r in loops.items())


def test_schema_rejects_what_it_must():
    from bench import schema

    rec = schema.result("a/b", 0.5, nbytes=1e9, formula="x")
    assert rec["system"] == "a" and rec["phase"] == "b" and rec["gbps"] == 2.0
    doc = json.loads(json.dumps(dict(schema.document("alloc", argv=[], params={"num_ranks": 1}, results=[rec],
                                                     baselines=["a/b"], checks={"ok": True}, mpi=False))))
    schema.validate(doc)
    for broken, needle in ((dict(doc, schema="other/1"), "schema"),
                           (dict(doc, results=[dict(rec, seconds=-1.0)]), "results/0/seconds"),
                           (dict(doc, results=[{k: v for k, v in rec.items() if k != "gbps"}]), "'gbps' is a required"),
                           (dict(doc, results=[rec, rec]), "duplicate names"),
                           (dict(doc, baselines=["nope"]), "are not results"),
                           (dict(doc, checks={}), "'ok' is a required"),
                           ({k: v for k, v in doc.items() if k != "host"}, "'host' is a required")):
        with pytest.raises(ValueError, match=needle):
            schema.validate(broken)
    assert schema.finite({"a": [float("nan"), 1.0, float("inf")]}) == {"a": [None, 1.0, None]}


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(600)
@ONE_RANK
def test_phases_and_native_split_flags_print_and_write_their_tables(commands_job):
    """``--phases`` at 2 ranks: per op a table whose phases tile the call (shares near 1, each share in [0, 1]),
    the ops each command makes named, the same table in the document's ``details.phases``. ``--native-split`` in
    the same runs (and ``overhead``'s): per op the median call split into time in native calls and outside them
    (the two add up to the call, the native functions' times to the native time), in ``details.native_split``."""
    expect = {
        "normal": {"deepep_ascend.layout": "get_dispatch_layout", "deepep_ascend.dispatch": "dispatch",
                   "deepep_ascend.combine": "combine"},
        "low-latency": {"dispatch": "low_latency_dispatch", "combine": "low_latency_combine",
                        "dispatch send": "low_latency_dispatch", "dispatch hook": "low_latency_dispatch hook",
                        "combine send": "low_latency_combine", "combine hook": "low_latency_combine hook"},
        "ep": {"epbuffer.dispatch": "ep_dispatch", "epbuffer.combine": "ep_combine",
               "buffer_v1.dispatch": "dispatch", "buffer_v1.combine": "combine"},
    }
    for command, ops in expect.items():
        run = commands_job[f"{command} --phases"]
        doc, out = run.doc(), run.out
        _check_doc(doc, command, 2)
        if command == "low-latency" and native.ll_available():
            assert doc["details"]["config"]["stream_rows"] == "always" and "recv_x by streaming stores, " in out
        table = doc["details"]["phases"]
        assert doc["params"]["phases"] is True
        for step, op in ops.items():
            entry = table[step]
            assert entry["ops"] == [op] and entry["ranks"] == 2 and entry["iterations"] == doc["params"]["iters"]
            names = [r["phase"] for r in entry["phases"]]
            assert "other" in names and len(set(names)) == len(names), names
            assert all(0 <= r["share"] <= 1 and r["median_us"] >= 0 for r in entry["phases"]), entry
            assert math.isclose(sum(r["share"] for r in entry["phases"]), 1.0, rel_tol=1e-9), entry  # they tile
            call = entry["call"]
            assert call["mean_us"] <= call["busiest_us"] + 1e-9, entry
            assert math.isclose(sum(r["busiest_us"] for r in entry["phases"]), call["busiest_us"], rel_tol=1e-9)
            assert f"[phases] {step}: {op} (" in out, (step, out[-3000:])
        waits = [r["phase"] for e in table.values() for r in e["phases"] if r["phase"].startswith("wait: ")]
        assert waits, table  # waits for peers are their own phases
        assert doc["params"]["native_split"] is True
        _check_native_split(doc["details"]["native_split"], list(ops), doc["params"]["iters"], out)
    run = commands_job["overhead --native-split"]
    doc, out = run.doc(), run.out
    from bench import schema

    schema.validate(doc)
    assert doc["checks"]["ok"] is True, doc["checks"]
    _check_native_split(doc["details"]["native_split"], [f"{s} T=1 {c}" for s in ("low_latency", "ep")
                                                         for c in ("dispatch", "combine")]
                        + [f"normal T=1 {c}" for c in ("layout", "dispatch", "combine")], 2, out)
    # --bindings: both ways timed per library system, with the native calls and arguments of a round trip
    from deepep_ascend.native.loader import bindings

    if bindings() == "fastcall":
        for s in ("low_latency", "normal"):
            calls, nargs = doc["summary"][f"{s}_native_calls_t1"], doc["summary"][f"{s}_native_args_t1"]
            assert 0 < calls <= nargs and isinstance(doc["summary"][f"{s}_bindings_saving_t1"], float), doc["summary"]
            assert re.search(rf"\[bindings\] T=1 +{s} +through the METH_FASTCALL bindings [\d.]+ ms, through ctypes "
                             rf"[\d.]+ ms: .*; {calls} native calls of {nargs} arguments", out), out[-3000:]
    else:
        assert "[skip]     bindings: not run: the METH_FASTCALL bindings are not loaded" in out, out[-3000:]


def _check_native_split(table: dict, ops: list, iters: int, out: str) -> None:
    """A ``--native-split`` table (``bench.native_split.split_table``) has ``ops`` (and maybe more), each
    consistent."""
    from deepep_ascend.native.loader import Kernels, available

    assert set(ops) <= set(table), (sorted(table), ops)
    for name, op in table.items():
        assert op["ranks"] == 2 and op["iterations"] == iters, op
        assert op["call_us"] > 0 and 0 <= op["native_us"] <= op["call_us"], op
        assert math.isclose(op["native_us"] + op["outside_us"], op["call_us"], rel_tol=1e-9), op
        assert math.isclose(op["outside_share"], op["outside_us"] / op["call_us"], rel_tol=1e-9), op
        assert op["call_us"] <= op["busiest"]["call_us"] + 1e-9, op  # the mean over ranks of each rank's median
        assert math.isclose(op["busiest"]["native_us"] + op["busiest"]["outside_us"], op["busiest"]["call_us"])
        assert {k["kernel"] for k in op["kernels"]} <= set(Kernels.__slots__), op
        assert math.isclose(sum(k["us"] for k in op["kernels"]), op["native_us"], rel_tol=1e-9, abs_tol=1e-9), op
        assert f"[native] {name}: call " in out, (name, out[-3000:])
    if available():  # every command's calls run native code where it is built
        assert all(op["native_us"] > 0 for n, op in table.items() if "dispatch" in n), table


def test_native_split_lines_say_when_there_is_nothing_native(monkeypatch):
    """``--native-split``'s printed lines: a table entry as ``call = native + outside (share)``, a line when no
    library call ran, and a first line when the native kernels are not loaded."""
    from bench.native_split import split_lines, split_table
    from deepep_ascend import native

    per_rank = [[{"op": {"call_ns": 3000, "native_ns": 1000, "kernels": {"ll_route": 1000}}}] for _ in range(2)]
    table = split_table(per_rank)
    assert table["op"]["outside_us"] == 2.0 and table["op"]["outside_share"] == 2 / 3
    monkeypatch.setattr(native, "available", lambda: True)
    lines = split_lines(table)
    assert len(lines) == 1 and "call 3.0 us" in lines[0] and "native 1.0 + outside 2.0 (66.7% outside)" in lines[0]
    assert lines[0].endswith("native us: ll_route 1.0")
    assert split_lines({}) == ["[native] no library call ran (--systems): nothing to split"]
    monkeypatch.setattr(native, "available", lambda: False)
    assert split_lines(table)[0].startswith("[native] the native kernels are not loaded")


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(600)
@ONE_RANK
def test_low_latency_compares_the_combines_send_modes(commands_job):
    """``--compare-sends`` times both send modes in every iteration (the JSON's ``compare_sends``: each mode's
    dispatch and combine, ``--iters`` times each) and prints their medians on one ``[sends]`` line; the mode in
    force afterwards is the run's own."""
    run = commands_job["low-latency --warmup-s 0"]
    det = run.doc()["details"]
    modes = ("never", "always")
    assert set(det["compare_sends"]) == {f"{p} {m}" for p in ("dispatch", "combine") for m in modes}
    assert all(len(v["times_s"]) == 2 for v in det["compare_sends"].values())  # --iters 2
    cs = {k: v["median_s"] * 1e3 for k, v in det["compare_sends"].items()}
    line = next(ln for ln in run.out.splitlines() if ln.startswith("[sends]"))
    assert f"combine {cs['combine never']:.3f} / {cs['combine always']:.3f}" in line, line
    assert "[sends]" not in commands_job["low-latency --warmup-s 0.4"].out
    # with --zero-copy no row is copied: nothing to compare, said so (and no streamed rank claimed)
    zc = commands_job["low-latency --phases"]
    assert zc.doc()["details"]["compare_sends"] == {"not_compared": "with --zero-copy the combine copies no row (the "
                                                                     "receivers read them where they lie)"}
    assert "[sends]  not compared: with --zero-copy" in zc.out
    assert zc.doc()["details"]["config"]["streamed_send_ranks"] == 0


def test_ep_compares_the_combines_send_modes(commands_job):
    """``ep --compare-sends`` times EPBuffer's round trip with both send modes in every iteration (``compare_sends``
    in the document, ``--iters`` times each) and prints the medians on one ``[sends]`` line."""
    run = commands_job["ep --expand, one rounding"]
    cs = run.doc()["details"]["compare_sends"]
    assert set(cs) == {f"{p} {m}" for p in ("dispatch", "combine") for m in ("never", "always")}
    assert all(len(v["times_s"]) == 1 for v in cs.values())  # --iters 1
    ms = {k: v["median_s"] * 1e3 for k, v in cs.items()}
    line = next(ln for ln in run.out.splitlines() if ln.startswith("[sends]"))
    assert f"combine {ms['combine never']:.3f} / {ms['combine always']:.3f}" in line, line
    assert commands_job["ep"].doc()["details"]["compare_sends"] is None
    across = commands_job["ep --expand across two nodes"]  # (one rank per node: nothing staged on one node)
    assert across.doc()["details"]["compare_sends"] == {
        "not_compared": "across nodes the combine stages no rows on the native one-node path"}
    assert "[sends]    not compared: across nodes" in across.out


def test_traffic_per_call_does_not_depend_on_how_long_the_warm_up_ran(commands_job):
    """``low-latency`` and ``engram`` report the bytes one call moves (traffic counted over the whole loop, divided
    by the calls): the same workload gives the same bytes per call whether the warm-up ran its ``--warmup`` calls
    alone or on for ``--warmup-s`` seconds, many more calls."""
    per_call = {}
    for command, key in (("low-latency", "moved_by_kind_per_rank"), ("engram", "moved_per_fetch")):
        for seconds in WARM_UPS:
            det = commands_job[f"{command} --warmup-s {seconds}"].doc()["details"]
            if command == "low-latency":
                b = det["bytes"]
                assert (b["calls"] == 3) == (seconds == "0"), b["calls"]  # --iters 2 --warmup 1, or more calls
                per_call[command, seconds] = [{k: v / b["calls"] for k, v in r.items()} for r in b[key]]
            else:
                per_call[command, seconds] = det[key]
        short, long = WARM_UPS
        assert per_call[command, short] == per_call[command, long], (command, per_call)
        assert any(v for r in (per_call[command, short] if command == "low-latency" else [per_call[command, short]])
                   for v in r.values()), per_call  # something moved
