"""`jaxllm plan [--config NAME|FILE] [key=value ...] [--json] [--chip NAME]`: what one train step costs per device.

Compiles the train step for a config on this machine's devices, without running it and without
loading any data, and prints per device its memory and collectives beside the theory: ZeRO, tensor,
context and pipeline parallelism, attention, generation, the gradient all-reduce, ZeRO++ and
fine-tuning (`jaxllm.plan` computes the plan and says what each number means; `jaxllm.plan.report`
writes the table).

Config handling is the same as `jaxllm train`: jaxllm/configs/default.toml unless `--config`
gives a shipped config's name or a file, then the `key=value` overrides; `model.vocab_size=0`
takes the tokenizer's size. A config mistake is one line `error: ...` on stderr and exit code 2.
Logs and the human-readable table go to stderr and stdout; with `--json`, the last line
of stdout is one JSON object (the dict `jaxllm.plan.plan(cfg)` returns).
"""

from __future__ import annotations

import json
import logging
import sys

from jaxllm import cli


def main(argv: list[str] | None = None) -> int:
    parser = cli.config_parser("jaxllm plan", __doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object on the last stdout line")
    parser.add_argument("--chip", help="add a roofline step time on this chip (h100, h200, tpu-v5p, tpu-v6e: its "
                        "peak FLOP/s and HBM bandwidth) from the compiled FLOPs and bytes")
    args = parser.parse_args(argv)

    def go():
        from jaxllm.mesh import initialize_distributed
        from jaxllm.plan import format_table, plan

        cfg = cli.load_config(args)
        initialize_distributed(cfg.distributed)
        result = plan(cfg, args.chip)
        logging.getLogger("jaxllm").info("compiled in %.1f s", result["compile_seconds"])
        if args.json:
            print(format_table(result), file=sys.stderr)
            print(json.dumps(result, separators=(",", ":"), ensure_ascii=True))
        else:
            print(format_table(result))

    return cli.run(go)


if __name__ == "__main__":
    sys.exit(main())
