"""MXFP8 through torchao: conversion of linear layers and the shared reference quantizer."""
