import sys
from pathlib import Path

# Test helpers (hf_oracle, helpers_ckpt) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
