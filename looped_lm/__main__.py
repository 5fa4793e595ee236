from looped_lm.cli import main
import sys
sys.exit(main())
