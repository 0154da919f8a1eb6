import sys

from memfit.measure.worker import main

sys.exit(main(sys.argv[1:]))
