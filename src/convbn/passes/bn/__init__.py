"""BatchNorm recognised however it is written (modules, norm-act subclasses, frozen BatchNorms, functional calls, BatchNorm1d over tokens), for both passes."""
