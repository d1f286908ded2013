// LD_PRELOAD shim: logs the address of each malloc of 4 MiB or 16 MiB (the bench's 1K and 4K
// decode caches). Build: gcc -O2 -shared -fPIC -o shim.so malloc_shim.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static void* (*real_malloc)(size_t)=0;
void* malloc(size_t n){
  if(!real_malloc) real_malloc=dlsym(RTLD_NEXT,"malloc");
  void* p=real_malloc(n);
  if(n==4194304 || n==16777216){
    char b[96]; int l=snprintf(b,sizeof b,"[malloc] %zu %p mod64=%lu\n",n,p,(unsigned long)p%64);
    write(2,b,l);
  }
  return p;
}
