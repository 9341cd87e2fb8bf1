"""The no-op executor the bwrap benchmark runs: read the JSON args, answer ``{}``."""

import sys

sys.stdin.read()
sys.stdout.write("{}\n")
