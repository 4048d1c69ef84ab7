#!/usr/bin/env python3
"""g5g-images: build, inspect, smoke-test and benchmark LLM serving images for sm_75 (AWS G5g).

    python build.py --runtime vllm --push
"""
import sys

from g5g.cli import main

if __name__ == "__main__":
    sys.exit(main())
