#version 450
#define QFMT 8
#define MULTI 1
#extension GL_GOOGLE_include_directive : require
#include "mvq.glsl"
