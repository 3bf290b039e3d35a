"""Mutation check of the safety invariants: each mutant below changes one snippet of one file so
that exactly one promised behaviour breaks, and the tests named for that behaviour must then
fail. A mutant they let through is a promise no test holds.

    python scripts/mutants.py              every mutant (``make mutants``)
    python scripts/mutants.py NAME ...     only these
    python scripts/mutants.py --list       the mutants and the invariants they break

The working tree's files (``git ls-files --cached --others --exclude-standard``: tracked and
new ones, as they are now) are copied into a temporary directory, once per job (``--jobs``,
2 by default: mutants run two at a time); the unmutated copy must pass every named test first
(else a failure would prove nothing); then each mutant is applied in a copy, its tests run
(``pytest -x``, never the e2e or slow ones), and the file restored. The checkout itself is
never touched, and each copy imports its own packages (``PYTHONPATH``), not the editable
install's. Exits non-zero when a mutant survives, when its original snippet is not found
exactly once (the code moved on: fix the mutant rather than let it rot) or when a named test
does not run.

No mutant touches engine/worker/csrc/: the compiled kernels are cached by their sources' hash
(engine/worker/cpu_kernels.py), so the copy reuses this machine's build, which one C++ mutant
would turn into a compile per run. The kernels' precision is held at the Python side here
(the digits each weight width gets, the quantizer's rounding); tests/test_cpu_kernels*.py
check the builds against float64 references.

A feature that adds an invariant adds its mutant here, with the fast test that holds it.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not e2e and not slow")
TIMEOUT = 600  # seconds for one run of a mutant's tests


@dataclass(frozen=True)
class Mutant:
    name: str
    invariant: str  # the promise the mutant breaks, in one line
    path: str
    original: str  # found exactly once in ``path``
    replacement: str
    tests: tuple[str, ...]  # pytest node ids (or files) that must fail under it


MUTANTS = (
    # ---------------------------------------------------------- cache namespaces and salts
    Mutant("tree-namespaces", "different namespaces never share a radix tree",
           "radix/tree.py",
           "    def _root(self, namespace: Hashable) -> Node:\n",
           "    def _root(self, namespace: Hashable) -> Node:\n        namespace = None\n",
           ("tests/test_radix.py::test_namespaces_never_share",)),
    Mutant("salt-namespace", "requests with different cache_salts get different namespaces",
           "engine/server/service.py",
           "msgspec.json.encode([owner, cache_salt])", "msgspec.json.encode([owner])",
           ("tests/test_server_app.py::test_salts_and_users_key_the_cache_namespace",)),
    Mutant("user-namespace", "under --salt-from-user, each user has a namespace of their own",
           "engine/server/service.py",
           "owner = user if self.options.salt_from_user and user else None", "owner = None",
           ("tests/test_server_app.py::test_salts_and_users_key_the_cache_namespace",)),
    Mutant("lora-namespace-salt", "an adapter's namespace keeps the request's cache_salt",
           "engine/contracts/lora.py",
           'return own if namespace is None else f"{namespace}|{own}"', "return own",
           ("tests/test_lora.py::test_a_prefix_cached_by_the_base_model_is_no_hit_for_an_adapter",)),
    Mutant("lora-namespace-weights", "an adapter reloaded with other weights reads none of the "
           "old ones' cache", "engine/contracts/lora.py",
           'own = f"lora:{adapter.name}:{adapter.content_hash}"', 'own = f"lora:{adapter.name}"',
           ("tests/test_lora.py::test_an_adapter_reloaded_with_new_weights_answers_with_them",)),
    Mutant("suffix-namespace", "suffix drafts come only from the request's own namespace",
           "scheduler/speculation.py",
           "self.suffix.propose(tokens, seq.req.namespace, k)", "self.suffix.propose(tokens, None, k)",
           ("tests/test_suffix.py::test_drafts_from_the_cache_stay_in_the_requests_namespace",)),
    # ------------------------------------------------------------- the disk tier's fingerprint
    Mutant("disk-fingerprint-page-size", "a disk directory is named by the page size too",
           "engine/worker/tier_io.py",
           '"kv_dtype": str(runner.kv_dtype), "page_size": c.page_size,',
           '"kv_dtype": str(runner.kv_dtype),',
           ("tests/test_disk_fingerprint.py::test_dtypes_and_pages_have_fingerprints_of_their_own",)),
    Mutant("disk-fingerprint-kv-dtype", "a disk directory is named by the KV dtype too",
           "engine/worker/tier_io.py",
           '"dtype": str(runner.dtype), "kv_dtype": str(runner.kv_dtype), ',
           '"dtype": str(runner.dtype), ',
           ("tests/test_disk_fingerprint.py::test_dtypes_and_pages_have_fingerprints_of_their_own",)),
    Mutant("disk-fingerprint-formats", "a disk directory is named by every weight's format",
           "engine/worker/tier_io.py", '        "weight_formats": formats,\n', "",
           ("tests/test_disk_fingerprint.py::test_every_weight_format_has_a_fingerprint_of_its_own",)),
    Mutant("disk-fingerprint-files", "a checkpoint's weight file rewritten names another "
           "disk directory", "engine/worker/tier_io.py",
           "[os.path.basename(file), st.st_size, st.st_mtime_ns]",
           "[os.path.basename(file), st.st_size]",
           ("tests/test_disk_fingerprint.py::test_another_checkpoints_files_name_it",)),
    Mutant("disk-fingerprint-gguf", "a converted GGUF names its disk directory by the file's "
           "content", "engine/worker/tier_io.py",
           'return {"gguf_sha256": converted["sha256"],', 'return {"gguf_sha256": None,',
           ("tests/test_disk_fingerprint.py::test_a_gguf_is_named_by_its_content",)),
    Mutant("disk-block-namespace", "disk blocks of different namespaces (adapters, salts) "
           "have different names",
           "engine/contracts/disk_blocks.py",
           'seed += b"\\x01" + str(namespace).encode()', 'seed += b"\\x01"',
           ("tests/test_disk_fingerprint.py::test_an_adapters_blocks_are_named_by_its_content",)),
    Mutant("disk-fingerprint-sliding", "a disk directory is named by which layers keep their "
           "KV apart (sliding windows)", "engine/worker/tier_io.py",
           '"sliding_layers": split or None,', '"sliding_layers": None,',
           ("tests/test_sliding_disk.py::test_a_windowed_directory_is_not_read_by_a_full_kv_engine",)),
    Mutant("disk-fingerprint-draft", "a disk directory is named by the draft model whose KV "
           "its blocks hold", "engine/worker/tier_io.py",
           '"draft": (_model_identity(draft.checkpoint, draft.runner)\n'
           '                  if draft is not None else None),', '"draft": None,',
           ("tests/test_draft_tiers.py::test_blocks_written_with_another_draft_or_none_are_not_served",)),
    Mutant("draft-disk-saves-at-release", "with a draft model, blocks go to disk once the "
           "draft has computed their KV (at release)", "scheduler/kv.py",
           "if not self.saves_at_release:", "if True:",
           ("tests/test_draft_tiers.py::test_a_restart_reads_the_drafts_kv_from_disk",)),
    Mutant("draft-host-copy-refresh", "a host copy made before the draft computed its KV gets "
           "it once computed", "engine/worker/draft.py", "        if len(stale):",
           "        if False:",
           ("tests/test_draft_tiers.py::test_the_drafts_kv_goes_to_the_host_tier_and_comes_back",)),
    # ------------------------------------------- cache keys of converted and quantized weights
    Mutant("quantized-key-size-mtime", "an edited checkpoint is quantized again",
           "engine/checkpoints/quantized.py",
           "identity += [file.name, str(stat.st_size), str(stat.st_mtime_ns)]",
           "identity += [file.name]",
           ("tests/test_quant_models.py::test_an_edited_checkpoint_is_quantized_again",)),
    Mutant("quantized-key-size", "a weight file of another size is quantized again",
           "engine/checkpoints/quantized.py",
           "identity += [file.name, str(stat.st_size), str(stat.st_mtime_ns)]",
           "identity += [file.name, str(stat.st_mtime_ns)]",
           ("tests/test_quant_models.py::test_an_edited_checkpoint_is_quantized_again",)),
    Mutant("quantized-key-mtime", "a weight file rewritten in place is quantized again",
           "engine/checkpoints/quantized.py",
           "identity += [file.name, str(stat.st_size), str(stat.st_mtime_ns)]",
           "identity += [file.name, str(stat.st_size)]",
           ("tests/test_quant_models.py::test_an_edited_checkpoint_is_quantized_again",)),
    Mutant("gguf-key-content", "a GGUF's conversion is keyed by its content, not its name",
           "engine/checkpoints/gguf.py",
           'f"{sha256}\\0{CONVERTER_VERSION}', 'f"{path.name}\\0{CONVERTER_VERSION}',
           ("tests/test_gguf.py::test_a_second_start_reuses_the_conversion_and_a_changed_file_does_not",)),
    # ----------------------------------------------------------- rollbacks and page accounting
    Mutant("rollback-pages", "rejected drafts give their pages back",
           "scheduler/kv.py",
           "keep = self.alloc.pages_for(upto)", "keep = len(seq.pages)",
           ("tests/test_suffix.py::test_wrong_drafts_from_the_cache_roll_back_with_the_accounting_clean",)),
    Mutant("rollback-tokens", "a verification keeps its accepted drafts and the token after "
           "them, no more", "scheduler/speculation.py",
           "            seq.draft_backoff = FIRST_PAUSE\n        return accepted + 1\n",
           "            seq.draft_backoff = FIRST_PAUSE\n        return drafted + 1\n",
           ("tests/test_speculation.py::test_greedy_outputs_are_those_of_decoding_without_drafts",)),
    Mutant("acceptance-stops-at-first-miss", "a verification accepts drafts up to its first "
           "rejected one", "scheduler/speculation.py",
           "np.minimum.reduceat(np.where(agree, np.repeat(counts, counts), local), offsets)",
           "np.add.reduceat(agree.astype(np.int64), offsets)",
           ("tests/test_speculation_rules.py::test_a_steps_acceptances_in_one_pass_are_those_of_each_verification",)),
    Mutant("grammar-verify-masks", "a constrained verify row is sampled under its grammar's "
           "state after the drafts before it", "engine/worker/grammar_drafts.py",
           "            fill(v.walk.matcher, bitmask, v.index + j)\n            if j:\n"
           "                v.walk.matcher.rollback(1)\n",
           "            if j:\n                v.walk.matcher.rollback(1)\n"
           "            fill(v.walk.matcher, bitmask, v.index + j)\n",
           ("tests/test_structured_speculation.py::test_cache_drafts_give_the_outputs_of_decoding_without_drafts",)),
    Mutant("check-tree-holders", "the accounting check fails on a reference nobody holds",
           "radix/accounting.py", "assert bad.size == 0, (", "assert bad.size >= 0, (",
           ("tests/test_radix.py::test_check_catches_a_leaked_reference",)),
    Mutant("check-sequence-holders", "the scheduler's check counts every live sequence's "
           "references", "scheduler/kv.py", "self.tree.check(refs, self._sliding_refs(seqs))",
           "self.tree.check()",
           ("tests/test_seq_memory.py::test_the_check_counts_every_sequences_references",)),
    Mutant("sliding-window-start", "a sequence keeps the sliding KV of every position its next "
           "query sees", "radix/sliding.py", "max(0, position + 1 - self.window)",
           "max(0, position + 2 - self.window)",
           ("tests/test_sliding_properties.py::TestSlidingRadixMachine::runTest",)),
    Mutant("sliding-match-window", "a match ends where the window before it is live",
           "radix/windows.py", "np.maximum(lengths + 1 - window, 0)",
           "np.maximum(lengths + 2 - window, 0)",
           ("tests/test_sliding_properties.py::test_a_match_ends_at_the_last_point_whose_window_is_live",)),
    Mutant("sliding-rollback", "rejected drafts give their sliding-window pages back",
           "scheduler/kv.py", "self.sliding.decref(seq.pages[max(keep, seq.lease.swa_from) :])",
           "pass",
           ("tests/test_sliding_speculation.py::test_prompt_lookup_drafts_roll_back_both_pools_and_keep_the_tokens",)),
    Mutant("sliding-swap-in", "a swapped-in window gets its sliding KV back", "scheduler/kv.py",
           "work.swa_swap_in.append((host, int(self.sliding.of[page])))", "pass",
           ("tests/test_sliding_swap.py::test_swapped_windows_come_back_and_decode_like_transformers",)),
    Mutant("sliding-host-window-load", "a match read from the host tier gets its window's "
           "sliding KV back", "radix/windows.py",
           "self.host.plan_window_loads(sources[window:].tolist(), device[window:].tolist())",
           "None",
           ("tests/test_sliding_properties.py::test_windows_go_down_to_the_host_tier_and_come_back_with_their_nodes",)),
    Mutant("sliding-host-window-write", "a node leaving the device takes its windows to its "
           "host copy (under write-through too)", "radix/tiering.py",
           "self._write_windows(node)  # its host copy takes its windows first", "None",
           ("tests/test_sliding_properties.py::test_windows_go_down_to_the_host_tier_and_come_back_with_their_nodes",)),
    Mutant("sliding-host-load-windows-only", "a host load takes sliding pages for the window "
           "before the match's end only", "radix/lease.py",
           "if tree.sliding is not None and (loads or reads > self.match.length):",
           "if False:",
           ("tests/test_sliding_properties.py::test_windows_go_down_to_the_host_tier_and_come_back_with_their_nodes",)),
    Mutant("sliding-host-window-evicted", "a window the device drops goes to its node's host "
           "copy first", "radix/windows.py",
           "            if node.host_pages:\n                self._write_windows(node)\n",
           "            if node.host_pages:\n                pass\n",
           ("tests/test_sliding_host.py::test_windows_go_to_the_host_tier_and_come_back",)),
    Mutant("sliding-host-admission", "admission counts sliding pages for a host load's "
           "window only", "scheduler/planner.py",
           "lease.pages_to_acquire(num_tokens, before, windows=True,\n"
           "                                             reads_from=reads_from)",
           "pages",
           ("tests/test_sliding_host.py::test_a_prompt_longer_than_the_sliding_pool_comes_back_from_the_host_tier",)),
    Mutant("sliding-disk-window-end", "a disk match ends where the window before it is read "
           "too", "scheduler/disk.py",
           "found = self._window_end(names[:found], first, cached)", "pass",
           ("tests/test_sliding_disk.py::test_a_disk_match_never_ends_where_its_window_is_missing",)),
    Mutant("sliding-disk-window-load", "a disk load reads its window's files into its "
           "sliding pages", "engine/worker/tier_io.py",
           "if payload is not None and (mine >= 0).any():", "if False:",
           ("tests/test_sliding_disk.py::test_windows_go_to_disk_and_a_restart_reads_them",)),
    Mutant("sliding-disk-windows-where-kept", "window files are written where the tree keeps "
           "a window, not at every chunk's end", "scheduler/disk.py",
           "windows = windows and self.sliding is not None",
           "windows = self.sliding is not None",
           ("tests/test_sliding_disk.py::test_a_disk_match_never_ends_where_its_window_is_missing",)),
    Mutant("sliding-disk-admission", "a disk load takes sliding pages for the window before "
           "its end only", "scheduler/kv.py",
           "seq.pages, copy = seq.lease.acquire(upto, reads_from=self.reads_from(seq))",
           "seq.pages, copy = seq.lease.acquire(upto)",
           ("tests/test_sliding_disk.py::test_a_prompt_longer_than_the_sliding_pool_comes_back_from_disk",)),
    Mutant("sliding-events-host-windows", "a router counts a block's window from the host "
           "copy's events too, not only from the device's",
           "tokenizer_worker/replica_cache.py",
           "kept = h in host or h in device and h in windows", "kept = h in windows",
           ("tests/test_kv_events_sliding.py::test_a_consumer_computes_the_engines_usable_match",)),
    # ----------------------------------------------------- LoRA: rows, names
    Mutant("lora-torch-row-order", "without the op, every row gets its own adapter's update "
           "(rows out of slot order too)", "engine/worker/lora_pool.py",
           "everything = len(rows) == count and bool(np.all(rows == np.arange(count)))",
           "everything = len(rows) == count",
           ("tests/test_lora_kernel.py::test_every_row_adapted_in_any_slot_order_gets_its_own_adapters_update",
            "tests/test_lora.py::test_every_row_adapted_out_of_slot_order_matches_peft")),
    Mutant("lora-loading-name", "a name that is still loading is refused",
           "scheduler/adapters.py",
           "if msg.name in self.served or msg.name in self.loading.values():",
           "if msg.name in self.served:",
           ("tests/test_lora.py::test_a_name_still_loading_is_refused",)),
    # ------------------------------------------------------------ kernels' precision bounds
    Mutant("int8-activation-digits", "8-bit weights get two activation digits",
           "engine/worker/model/quant.py",
           "DIGITS = {8: 2, 6: 2, 5: 2, 4: 1}", "DIGITS = {8: 1, 6: 2, 5: 2, 4: 1}",
           ("tests/test_quant.py::test_a_layer_gives_8_bit_weights_two_activation_digits_and_4_bit_ones_one",)),
    Mutant("int8-rounded-step", "int8 values are computed from the float16 step they are "
           "stored with", "engine/checkpoints/quant_formats.py",
           "        step = scales.float().clamp_min(tiny)\n        mins = (low + 128 * step)",
           "        step = ((high - low) / 255).clamp_min(tiny)\n        mins = (low + 128 * step)",
           ("tests/test_quant.py::test_int8_and_int4_quantize_to_the_nearest_steps",)),
    Mutant("int4-rounded-step", "int4 values are computed from the float16 step they are "
           "stored with", "engine/checkpoints/quant_formats.py",
           "    step = scales.float().clamp_min(tiny)[..., None]",
           "    step = ((high - mins.float()) / 15).clamp_min(tiny)[..., None]",
           ("tests/test_quant.py::test_int8_and_int4_quantize_to_the_nearest_steps",)),
    Mutant("quantized-projections", "int8 and int4 quantize all seven projections",
           "engine/checkpoints/quantized.py",
           r"(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj", r"(self_attn\.[qkvo]|mlp\.(gate|up))_proj",
           ("tests/test_quant_models.py::test_int8_and_int4_hold_all_seven_projections_of_every_layer",)),
    Mutant("quantized-partial-groups", "int8 and int4 keep a projection of partial groups dense "
           "instead of refusing the model", "engine/checkpoints/quantized.py",
           "if LINEAR.fullmatch(name) and _whole_blocks(reader.get_slice(name).get_shape()):",
           "if LINEAR.fullmatch(name):",
           ("tests/test_quant_models.py::test_projections_of_partial_groups_stay_dense_and_say_so",)),
    Mutant("int8-kv-rounding", "int8 KV rows round to the nearest step of their float16 scale",
           "engine/worker/kv_quant.py",
           "values = values.round_().clamp_(-QMAX, QMAX).to(torch.int8)",
           "values = values.clamp_(-QMAX, QMAX).to(torch.int8)",
           ("tests/test_kv_int8.py::test_quantize_matches_the_float64_reference_and_dequantize_is_exact",)),
    # ------------------------------------------------------------------ door authentication
    Mutant("key-compared", "a wrong API key is refused", "engine/server/pipeline.py",
           "if key is None or not hmac.compare_digest(key.encode(), self.api_key.encode()):",
           "if key is None:",
           ("tests/test_door_keys.py",)),
    Mutant("bearer-scheme", "only an 'Authorization: Bearer' header carries the key",
           "engine/server/pipeline.py",
           'return token.strip() if scheme.lower() == "bearer" else None',
           "return token.strip()",
           ("tests/test_door_keys.py::test_http_refuses_a_call_without_the_key",
            "tests/test_door_keys.py::test_grpc_refuses_a_call_without_the_key")),
    Mutant("metrics-behind-key", "/metrics needs the key unless --metrics-open",
           "engine/server/app.py",
           'open_paths = (OPEN_PATHS | {"/metrics"}) if service.options.metrics_open else OPEN_PATHS',
           'open_paths = OPEN_PATHS | {"/metrics"}',
           ("tests/test_tenant_isolation.py::test_metrics_open_serves_them_without_the_key",)),
    Mutant("zmq-door-key", "the ZMQ door refuses a call without the key",
           "engine/server/zmq_frontend.py",
           '            self.pipeline.authorize(call.api_key, "set api_key in each call")\n',
           "            pass\n",
           ("tests/test_door_keys.py::test_zmq_refuses_a_call_without_the_key",)),
    Mutant("grpc-door-key", "the gRPC door refuses a call without the key",
           "engine/server/grpc_frontend.py",
           "return None if handler is None else refusing(handler, exc.message)",
           "return handler",
           ("tests/test_door_keys.py::test_grpc_refuses_a_call_without_the_key",)),
)


def copy_tree(destination: Path) -> None:
    """The working tree's files that git does not ignore, as they are now (tracked ones
    deleted meanwhile left out)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name, follow_symlinks=False)


def run_tests(tree: Path, tests: list[str], *options: str) -> tuple[int, float, str]:
    """pytest over ``tests`` in ``tree``: (exit code, seconds, the output's tail)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *PYTEST, "-x", *options, *tests], cwd=tree,
                              env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - started, f"timed out after {TIMEOUT} s"
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    return done.returncode, time.monotonic() - started, tail


def write(path: Path, text: str) -> None:
    """``text`` into ``path``, its cached bytecode dropped: a mutant and its original of one
    size, written within one second, would otherwise pass for each other's (pyc files record
    the source's size and whole seconds of its time)."""
    path.write_text(text)
    for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink()


def try_mutant(tree: Path, m: Mutant) -> tuple[str, float, str]:
    """Apply ``m`` in ``tree``, run its tests, restore: (outcome, seconds, the output's tail)."""
    path = tree / m.path
    text = path.read_text()
    write(path, text.replace(m.original, m.replacement))
    try:
        rc, seconds, tail = run_tests(tree, list(m.tests))
    finally:
        write(path, text)
    outcome = {1: "caught", 0: "SURVIVED", -1: "caught (timed out)"}.get(
        rc, f"ERROR (pytest exit {rc})")
    return outcome, seconds, tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--jobs", type=int, default=2,
                        help="mutants run at once, each in a copy of its own (default 2)")
    args = parser.parse_args()
    known = {m.name: m for m in MUTANTS}
    unknown = [name for name in args.names if name not in known]
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)}; --list shows them")
    mutants = [known[name] for name in args.names] or list(MUTANTS)
    if args.list:
        for m in mutants:
            print(f"{m.name:32} {m.path:36} {m.invariant}")
        return 0
    started = time.monotonic()
    jobs = max(1, min(args.jobs, len(mutants)))
    with tempfile.TemporaryDirectory(prefix="radixserve-mutants-") as temp:
        trees = [Path(temp) / f"tree{i}" for i in range(jobs)]
        for tree in trees:
            copy_tree(tree)
        stale = [m.name for m in mutants
                 if (trees[0] / m.path).read_text().count(m.original) != 1]
        if stale:
            print(f"original snippets not found exactly once (update these mutants): "
                  f"{', '.join(stale)}")
            return 1
        named = list(dict.fromkeys(test for m in mutants for test in m.tests))
        parallel = ("-n", str(jobs), "--dist", "loadfile") if jobs > 1 else ()
        rc, seconds, tail = run_tests(trees[0], named, *parallel)
        if rc != 0:
            print(f"the unmutated tree fails the named tests ({seconds:.0f} s):\n{tail}")
            return 1
        print(f"unmutated: {len(named)} test ids pass ({seconds:.0f} s)", flush=True)
        waiting: queue.SimpleQueue[Mutant] = queue.SimpleQueue()
        for m in mutants:
            waiting.put(m)
        results: dict[str, tuple[str, float, str]] = {}
        printing = threading.Lock()

        def work(tree: Path) -> None:
            while True:
                try:
                    m = waiting.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[m.name] = try_mutant(tree, m)
                except Exception as exc:  # a broken copy: reported, the others go on
                    results[m.name] = "ERROR", 0.0, repr(exc)
                outcome, seconds, _ = results[m.name]
                with printing:
                    print(f"{m.name:32} {outcome:20} {seconds:5.0f} s  {m.invariant}",
                          flush=True)

        workers = [threading.Thread(target=work, args=(tree,)) for tree in trees]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    failures = [(m, *results[m.name]) for m in mutants
                if not results[m.name][0].startswith("caught")]
    for m, outcome, _, tail in failures:
        print(f"\n{m.name} {outcome}: {m.path}: {m.invariant}\n  tests: {' '.join(m.tests)}"
              f"\n{tail}")
    print(f"\n{len(mutants) - len(failures)} of {len(mutants)} mutants caught in "
          f"{time.monotonic() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
