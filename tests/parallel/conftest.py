import sys
from pathlib import Path

# The rank runner and the scenarios every rank runs live beside the tests (spawned ranks inherit sys.path).
sys.path.insert(0, str(Path(__file__).parent))
