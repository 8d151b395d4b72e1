#include "loom/loom.h"
#include <stdio.h>
int main(void) { printf("loom\n"); return 0; }
