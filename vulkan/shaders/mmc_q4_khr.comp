#version 450
#define QFMT 4
#extension GL_GOOGLE_include_directive : require
#include "mmc.glsl"
