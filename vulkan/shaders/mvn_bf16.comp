#version 450
#define WFMT 2
#define MULTI 1
#extension GL_GOOGLE_include_directive : require
#include "mv.glsl"
