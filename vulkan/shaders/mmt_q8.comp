#version 450
#define QFMT 8
#extension GL_GOOGLE_include_directive : require
#include "mmt.glsl"
