"""Scoring of model outputs (Lambada's acc_strict, BoolQ's boolq_acc); examples come from data/."""
