"""``radixserve generate``: offline batch generation from a JSONL file, with a progress bar."""

from __future__ import annotations

import argparse
import json
import sys

from engine.commands.options import add_engine_arguments, config_from_args

HELP = "generate offline for every line of a JSONL file (prompt or prompt_token_ids or messages)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True,
                        help="JSONL: one request a line with 'prompt' (text), 'prompt_token_ids' "
                             "or 'messages', and optional sampling fields (max_tokens, "
                             "temperature, top_p, top_k, seed, stop, n, ...)")
    parser.add_argument("--output", required=True, help="JSONL written in input order")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_arguments(parser)


def _read_requests(path: str):
    import msgspec

    from engine.contracts.sampling_params import SamplingParams

    prompts, params = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item.pop("prompt", None) or item.pop("prompt_token_ids", None) \
                    or item.pop("messages", None)
                item.pop("id", None)
                if prompt is None:
                    raise ValueError("needs 'prompt', 'prompt_token_ids' or 'messages'")
                p = msgspec.convert(item, SamplingParams)
                p.validate()
            except (ValueError, msgspec.ValidationError) as exc:
                raise SystemExit(f"{path}:{number}: {exc}") from None
            prompts.append(prompt)
            params.append(p)
    return prompts, params


def run(args: argparse.Namespace) -> int:
    import msgspec

    from engine.runtime.offline import Engine, EngineDead, LaunchError

    prompts, params = _read_requests(args.input)
    config = config_from_args(args)
    try:
        with Engine(**msgspec.structs.asdict(config)) as engine:
            info = engine.info
            print(f"radixserve: engine ready ({info.architecture}, {info.num_pages:,} pages of "
                  f"{info.page_size} on {info.device}); {len(prompts):,} requests",
                  file=sys.stderr, flush=True)
            results = engine.generate(prompts, params, use_tqdm=not args.no_progress)
    except (EngineDead, LaunchError) as exc:
        print(f"radixserve generate: {exc}", file=sys.stderr)
        return 1
    failed = 0
    with open(args.output, "w") as out:
        for result in results:
            failed += result.error is not None
            out.write(json.dumps({
                "id": result.rid, "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens, "error": result.error,
                "outputs": [{"text": c.text, "token_ids": c.token_ids,
                             "finish_reason": c.finish_reason} for c in result.outputs],
            }) + "\n")
    print(f"wrote {len(results)} results to {args.output} ({failed} failed)", file=sys.stderr)
    return 1 if failed else 0

