"""Writes TFDS `the_pile:1.0.0` into $TFDS_DATA_DIR (or --data_dir), like Pax's script of this name.

    TFDS_DATA_DIR=/data/tfds python scripts_gpu/download_the_pile.py [--local_dir=PATH] [--file_format=array_record|tfrecord]
"""

import sys

from paxlite.data.tfds_datasets import THE_PILE, download_main

if __name__ == "__main__":
    sys.exit(download_main(THE_PILE, source_flag="local_dir",
                           source_help="a directory holding The Pile's train/NN.jsonl.zst and val.jsonl.zst (test.jsonl.zst optional); without it the original host is tried"))
