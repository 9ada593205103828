"""switchyard"""
