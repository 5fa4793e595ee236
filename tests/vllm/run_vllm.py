"""Greedy generation with vLLM's offline engine, in its own process: prints one JSON line
{"tokens": [[...], ...], "logprobs": [[...], ...]} for the prompts given as JSON in argv[2]
(argv: HF_DIR PROMPTS_JSON MAX_TOKENS [HF_OVERRIDES_JSON])."""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    hf_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None  # e.g. {"num_iterations": K}
    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=128,
              seed=0, hf_overrides=overrides)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    print("RESULT " + json.dumps({"tokens": tokens, "logprobs": logprobs}), flush=True)


if __name__ == "__main__":
    main()
