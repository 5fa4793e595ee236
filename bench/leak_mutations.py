"""Break the code on purpose, one way at a time, and run tests/test_no_leak.py against each break.

    python bench/leak_mutations.py      # ~3 min; restores every file it edits (check: git diff looped_lm)

Each mutation lets a training or scoring slot see its target or a later token; every one must turn
some test red. Writes bench/results/quality/leak/mutations.json. It edits looped_lm/ in place: run it
in a checkout no one else commits from. A SIGTERM (a timeout) still restores the file being mutated.
"""
import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
M = {
 "training slot reads its target as prev_token input (objective: prev = y)":
   ("looped_lm/models/db/objective.py", "targets, prev = y, x", "targets, prev = y, y"),
 "noisy slot t sees clean key t+1 (no-self-key causal mask shifted by one)":
   ("looped_lm/models/two_stream.py",
    "y = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=None if causal else mask, is_causal=causal)",
    "y = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=torch.ones(q.shape[2], k_ctx.shape[2], dtype=torch.bool, device=q.device).tril(1) if causal else mask)"),
 "noisy slots see every other slot's z (self-key mask: ones instead of eye)":
   ("looped_lm/models/two_stream.py",
    "own = torch.eye(n, dtype=torch.bool, device=ctx_end.device).expand(*ctx_end.shape[:-1], n, n)",
    "own = torch.ones(n, n, dtype=torch.bool, device=ctx_end.device).expand(*ctx_end.shape[:-1], n, n)"),
 "scoring slot reads the next clean token as prev_token input (WindowContext: prev = x shifted)":
   ("looped_lm/models/db/contexts.py", "kv, prev = self.kv[b], self.x", "kv, prev = self.kv[b], self.x.roll(-1, 1)"),
 "estimator tilts slot t's starting noise toward the NEXT slot's target (model._estimates)":
   ("looped_lm/models/db/model.py", "tilt = settings.tilt * self.targets(y) * (pilot < TILT_BELOW)",
    "tilt = settings.tilt * self.targets(y.roll(-1, 1)) * (pilot < TILT_BELOW)"),
 "clean stream not causal (full attention over the window)":
   ("looped_lm/models/layers.py", "return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
    "return F.scaled_dot_product_attention(q, k, v, is_causal=False)"),
}


def _stop(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")  # unwinds through the finally that restores the file


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    signal.signal(signal.SIGTERM, _stop)
    out = {}
    for name, (path, old, new) in M.items():
        p = ROOT / path
        text = p.read_text()
        assert text.count(old) == 1, (name, text.count(old))
        p.write_text(text.replace(old, new))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_no_leak.py"],
                               cwd=ROOT, capture_output=True, text=True)
            lines = r.stdout.strip().splitlines()
            failed = [l.split(" ")[1] for l in lines if l.startswith("FAILED")]
            out[name] = {"exit": r.returncode, "summary": lines[-1], "failed": failed}
            print(name, "->", lines[-1], flush=True)
        finally:
            p.write_text(text)
    subprocess.run(["git", "diff", "--stat", "looped_lm"], cwd=ROOT)
    (ROOT / "bench/results/quality/leak").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench/results/quality/leak/mutations.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
