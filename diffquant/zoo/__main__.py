"""python -m diffquant.zoo publish runs/train/zoo-baseline/final baseline"""

import sys

from diffquant.zoo import publish

if len(sys.argv) != 4 or sys.argv[1] != "publish":
    sys.exit("usage: python -m diffquant.zoo publish FINAL_DIR NAME")
print(publish(sys.argv[2], sys.argv[3]))
