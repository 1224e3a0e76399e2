"""``jaxinfer generate``: offline generation from the command line (docs/architecture.md "Public contract").

Prompts come from arguments, a text file (one prompt per line) or JSONL (``{"prompt": ...}`` or
``{"messages": [...]}`` plus optional sampling fields). Completions go to stdout as JSON lines
``{"prompt", "text", "token_ids", "finish_reason", "metrics"}`` (and to ``--output``), the progress bar and a
summary in vLLM/SGLang vocabulary to stderr. ``--json-schema FILE | --regex RE | --choice A,B,C | --grammar
FILE.lark`` constrain every output (a JSONL line's own ``"structured_outputs"`` wins). ``--speculative-tokens K``
(bench.add_speculative_flags) decodes with MTP speculative decoding and adds a line of its counts in vLLM's
spec-decode vocabulary (bench.format_speculative). ``--kv-cache-dir DIR`` keeps prompt pages in DIR for later
runs (the KV storage tier) and adds a line of the prefix cache's counts (bench.format_cache_stats). Chat requests
(``--chat`` or ``messages``) take ``--tools FILE.json``, ``--tool-choice`` and ``--chat-template-kwargs JSON``
(a JSONL line's ``"tools"`` / ``"tool_choice"`` / ``"chat_template_kwargs"`` win) and their lines carry
``"tool_calls"`` and ``"reasoning_content"`` when the replies hold them (engine/chat.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from jaxinfer import bench

CHAT_FIELDS = ("tools", "tool_choice", "chat_template_kwargs")  # chat requests' fields of a JSONL line
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "n", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "structured_outputs")


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="offline generation (vLLM-style)")
    gen.add_argument("prompt", nargs="*", help="prompts (text)")
    gen.add_argument("--model", default=None,
                     help="HF checkpoint directory or jaxinfer orbax directory (default: the embedded model)")
    gen.add_argument("--prompts", dest="prompt_file", help="a text file (one prompt per line) or .jsonl")
    gen.add_argument("--chat", action="store_true", help="wrap plain prompts in the tokenizer's chat template")
    gen.add_argument("--tools", metavar="FILE.json", help="chat requests get these tools (a JSON list of OpenAI "
                     "function definitions; a JSONL line's 'tools' overrides); completions carry 'tool_calls'")
    gen.add_argument("--tool-choice", default="auto", metavar="auto|none|required|NAME",
                     help="chat requests' tool_choice (a JSONL line's 'tool_choice' overrides; default auto)")
    gen.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                     help="extra variables for the chat template, a JSON object (e.g. '{\"thinking\": true}' for "
                          "DeepSeek-V3.1's; a JSONL line's 'chat_template_kwargs' overrides)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--output", help="write one JSON line per completion to this file")
    gen.add_argument("--expert-load-json", metavar="FILE",
                     help="after generating, write the tokens routed to each expert per MoE layer (LLM.expert_load)")
    constraint = gen.add_argument_group("structured output (one of; engine/structured_output.py)")
    one = constraint.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="outputs follow this JSON Schema")
    one.add_argument("--regex", metavar="RE", help="outputs match this regular expression")
    one.add_argument("--choice", metavar="A,B,C", help="outputs are one of these comma-separated strings")
    one.add_argument("--grammar", metavar="FILE.lark", help="outputs follow this Lark grammar (llguidance syntax)")
    bench.add_speculative_flags(gen)
    bench.add_kv_cache_flags(gen)
    pd = gen.add_argument_group("prefill/decode disaggregation across processes (engine/pd_remote.py)")
    pd.add_argument("--role", choices=("prefill", "decode"), default=None,
                    help="prefill: compute the prompts here, decode in the process serving --pd-address (prints "
                         "the completions); decode: serve --pd-address (no prompts) until the prefill process is "
                         "done")
    pd.add_argument("--pd-address", metavar="HOST:PORT", help="the decode process's address (it binds it)")
    pd.add_argument("--pd-timeout", type=float, default=30.0, metavar="S",
                    help="a peer silent this long is dead: its requests finish with an error (default 30)")
    pd.add_argument("--pd-connect-timeout", type=float, default=300.0, metavar="S",
                    help="how long to wait for the other process to first answer (default 300)")


def structured_outputs(args):
    """The StructuredOutputsParams of --json-schema / --regex / --choice / --grammar, or None."""
    import jaxinfer

    def read(path):
        try:
            return pathlib.Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None

    if args.json_schema:
        try:
            return jaxinfer.StructuredOutputsParams(json=read(args.json_schema))
        except ValueError as e:
            raise ValueError(f"--json-schema {args.json_schema}: {e}") from None
    if args.regex:
        return jaxinfer.StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return jaxinfer.StructuredOutputsParams(choice=[c for c in args.choice.split(",") if c])
    if args.grammar:
        return jaxinfer.StructuredOutputsParams(grammar=read(args.grammar))
    return None


def sampling_params(item: dict, defaults: dict):
    """A request's SamplingParams: the command's flags (``defaults``), overridden by its JSONL line's fields."""
    import jaxinfer

    return jaxinfer.SamplingParams(**{**defaults, **{k: item[k] for k in SAMPLING_FIELDS if k in item}})


def read_tools(path) -> list | None:
    """--tools FILE.json: the JSON list it holds (checked by the chat requests), or None without the flag."""
    if path is None:
        return None
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--tools {path}: cannot read a JSON list of tools ({e})") from None


def read_template_kwargs(text) -> dict | None:
    """--chat-template-kwargs JSON: the object it holds, or None without the flag."""
    from jaxinfer.engine.chat_protocol import json_object

    return None if text is None else json_object(text, "--chat-template-kwargs")


def read_requests(args) -> list[dict]:
    """[{"prompt": str} | {"messages": [...]}, plus sampling overrides], from arguments and --prompts."""
    requests = [{"prompt": p} for p in args.prompt]
    if args.prompt_file:
        path = pathlib.Path(args.prompt_file)
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            hint = "" if path.exists() else " (prompt text goes without a flag: jaxinfer generate \"TEXT\" ...)"
            raise ValueError(f"cannot read prompts file {path}: {e}{hint}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                requests.append({"prompt": line})
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
                raise ValueError(f"{path}:{number}: expected an object with exactly one of 'prompt' or 'messages'")
            unknown = set(item) - {"prompt", "messages", *CHAT_FIELDS, *SAMPLING_FIELDS}
            if unknown:
                raise ValueError(f"{path}:{number}: unknown field(s) {sorted(unknown)}")
            requests.append(item)
    if not requests:
        raise ValueError("no prompts: pass them as arguments or with --prompts FILE")
    return requests


def _percentile(values, q):
    import numpy as np

    return float(np.percentile(values, q)) if values else 0.0


def _open_for_writing(path, flag: str):
    """``path`` opened for writing (None: None), or ValueError naming ``flag``."""
    if path is None:
        return None
    try:
        return open(path, "w")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write it ({e.strerror})") from None


def write_expert_load(file, llm) -> None:
    """``LLM.expert_load()`` as JSON (``expert_load`` [num_moe_layers][n_routed_experts], as in the embedded model's
    expert_load.json) into ``file`` (open for writing; None on processes other than 0). Every process computes it
    (a collective read); process 0 writes."""
    config = llm.model.config
    load = llm.expert_load()
    if file is not None:
        with file:
            file.write(json.dumps({
                "description": "(token, expert) choices routed to each logical expert per MoE layer over the "
                               f"engine's last {llm.config.expert_load_window} steps (padding excluded)",
                "moe_layers": [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)],
                "expert_load": load.tolist()}, indent=1) + "\n")


def check_pd(args) -> None:
    """The prefill/decode flags' own consistency; cli.main checks them before JAX starts (a --coordinator run
    would otherwise wait for its other processes first)."""
    if (args.role is None) != (args.pd_address is None):
        raise ValueError("--role and --pd-address go together")
    if args.role == "decode" and (args.prompt or args.prompt_file):
        raise ValueError("--role decode takes no prompts: the prefill process sends them")
    if args.role is not None and args.coordinator is not None:
        raise ValueError("--role runs one process per side of the pair: a prefill or decode unit spanning "
                         "processes (--coordinator) is not supported")


def serve(args) -> int:
    """--role decode: the decode process's loop (pd_remote.DecodeServer); returns the exit status."""
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.pd_remote import DecodeServer

    config = EngineConfig(model=args.model, mesh=args.mesh, dtype=args.dtype, compilation_cache="off",
                          compile_ahead=False, speculative_config=bench.speculative_config(args))
    server = DecodeServer(config, args.pd_address, args.pd_timeout, args.pd_connect_timeout)
    print(f"[jaxinfer] decode process serving {args.pd_address}", file=sys.stderr, flush=True)
    return server.run()


def run(args) -> int | None:
    import jaxinfer
    from jaxinfer.engine.chat import chat_requests
    from jaxinfer.engine.chat_protocol import TOOL_CHOICES
    from jaxinfer.parallel import multihost

    check_pd(args)
    if args.role == "decode":
        return serve(args)
    requests = read_requests(args)
    constraint = structured_outputs(args)
    # The output files are opened before the model loads: an unwritable path fails now, not after the generation.
    output = _open_for_writing(args.output, "--output") if multihost.is_primary() else None
    load_file = _open_for_writing(args.expert_load_json, "--expert-load-json") if multihost.is_primary() else None
    # compilation_cache="off": the CLI has configured JAX's cache from --compilation-cache (cli._start_jax).
    # compile_ahead off: one generate call, then the process exits; other prefill block counts are not needed.
    pd = dict(pd_address=args.pd_address, pd_timeout=args.pd_timeout, pd_connect_timeout=args.pd_connect_timeout)
    pd = pd if args.role == "prefill" else {}
    llm = jaxinfer.LLM(args.model, mesh=args.mesh, dtype=args.dtype, compilation_cache="off", compile_ahead=False,
                       speculative_config=bench.speculative_config(args), **bench.kv_cache_options(args), **pd)
    defaults = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
                    seed=args.seed, structured_outputs=constraint)
    tools, tool_choice = read_tools(args.tools), args.tool_choice
    template_kwargs = read_template_kwargs(args.chat_template_kwargs)
    if tool_choice not in TOOL_CHOICES:
        tool_choice = {"type": "function", "function": {"name": tool_choice}}
    prompts, params, chats = [], [], []
    for number, item in enumerate(requests, 1):
        chat = None
        if ("messages" in item or args.chat) and llm.tokenizer is None:
            raise ValueError("--chat and 'messages' need tokenizer.json beside the checkpoint")
        try:
            request_params = sampling_params(item, defaults)
            if "messages" in item or args.chat:
                messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
                (chat,) = chat_requests(llm.tokenizer, [messages], item.get("tools", tools),
                                        item.get("tool_choice", tool_choice),
                                        item.get("chat_template_kwargs", template_kwargs))
                request_params = chat.params(request_params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"request {number}: {e}") from None
        params.append(request_params)
        chats.append(chat)
        prompts.append(item["prompt"] if chat is None else chat.prompt_token_ids)
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=True)
    finally:
        llm.close()  # --role prefill: the decode process exits once done
    duration = time.perf_counter() - start
    outputs = [out if chat is None else chat.parse(out, llm.tokenizer) for chat, out in zip(chats, outputs)]
    lines = []
    for item, out in zip(requests, outputs):
        for completion in out.outputs:
            line = {"prompt": item.get("prompt", item.get("messages")), "text": completion.text,
                    "token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason,
                    "metrics": out.metrics}
            if completion.error:
                line["error"] = completion.error
            for key in ("tool_calls", "reasoning_content"):  # chat requests' parsed replies
                if getattr(completion, key) is not None:
                    line[key] = getattr(completion, key)
            lines.append(json.dumps(line))
    if multihost.is_primary():  # all processes compute, process 0 writes
        print("\n".join(lines))
        if output is not None:
            with output:
                output.write("".join(line + "\n" for line in lines))
    if args.expert_load_json:
        write_expert_load(load_file, llm)
    n_in = sum(o.metrics["num_prompt_tokens"] for o in outputs)
    n_out = sum(o.metrics["num_output_tokens"] for o in outputs)
    ttft = [o.metrics["ttft_s"] * 1e3 for o in outputs if o.metrics["ttft_s"] is not None]  # None: an error
    tpot = [o.metrics["tpot_s"] * 1e3 for o in outputs if o.metrics["num_output_tokens"] > 1]
    print(f"[jaxinfer] requests {len(outputs)}, duration {duration:.2f} s, input {n_in / duration:.1f} tok/s, "
          f"output {n_out / duration:.1f} tok/s, total {(n_in + n_out) / duration:.1f} tok/s, "
          f"TTFT p50 {_percentile(ttft, 50):.1f} ms p99 {_percentile(ttft, 99):.1f} ms, "
          f"TPOT p50 {_percentile(tpot, 50):.1f} ms p99 {_percentile(tpot, 99):.1f} ms", file=sys.stderr)
    spec = llm.config.speculative_config
    if spec is not None:
        print(f"[jaxinfer] {bench.format_speculative(bench.speculative_metrics(llm.stats, spec))}", file=sys.stderr)
    if args.kv_cache_dir is not None:
        print(f"[jaxinfer] {bench.format_cache_stats(llm.cache_stats())}", file=sys.stderr)
