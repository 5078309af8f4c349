"""Writes TFDS `super_glue/boolq:1.0.2` into $TFDS_DATA_DIR (or --data_dir), like Pax's script of this name.

    TFDS_DATA_DIR=/data/tfds python scripts_gpu/download_boolq.py [--local_dir=PATH] [--file_format=array_record|tfrecord]
"""

import sys

from paxlite.data.tfds_datasets import BOOLQ, download_main

if __name__ == "__main__":
    sys.exit(download_main(BOOLQ, source_flag="local_dir",
                           source_help="a directory holding BoolQ's train.jsonl and val.jsonl (SuperGLUE's BoolQ.zip unpacked); without it the zip is downloaded"))
