"""Stands in for `torchrun` in the example scripts' tests (`LAUNCHER=...`): prints the argument
list it was given as JSON, so a test reads exactly what a script would launch."""

import json
import sys

print(json.dumps(sys.argv[1:]))
