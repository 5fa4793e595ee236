"""`deepspeed looped_lm/train.py --config X.yaml` and `python -m looped_lm.train --config X.yaml`: the trainer's
entry point as a script. The trainer itself is the package looped_lm/trainer."""

import sys

from looped_lm.trainer.command import main

if __name__ == "__main__":
    sys.exit(main())
