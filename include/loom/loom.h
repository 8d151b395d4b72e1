/*
 * loom.h — the umbrella header: include this and nothing else.
 */
#ifndef LOOM_H
#define LOOM_H

#include "loom/core.h"
#include "loom/io.h"

#endif
