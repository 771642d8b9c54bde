/* Rotary position embeddings: see rope.h. */
#include <math.h>

#include "rope.h"

#define REAL float
#define SUFFIX f32
#include "rope_impl.h"
#undef REAL
#undef SUFFIX

#define REAL double
#define SUFFIX f64
#include "rope_impl.h"
#undef REAL
#undef SUFFIX
