"""Writes TFDS `my_lambada:1.0.0` into $TFDS_DATA_DIR (or --data_dir), like Pax's script of this name.

    TFDS_DATA_DIR=/data/tfds python scripts_gpu/download_lambada.py [--local_file=PATH] [--file_format=array_record|tfrecord]
"""

import sys

from paxlite.data.tfds_datasets import LAMBADA, download_main

if __name__ == "__main__":
    sys.exit(download_main(LAMBADA, source_flag="local_file",
                           source_help="lambada_test.jsonl (OpenAI's file, one {'text': ...} per line); without it it is downloaded from GitHub"))
